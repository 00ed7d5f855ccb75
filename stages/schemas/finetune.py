"""The finetune stage's config (stages/finetune/), its rules, and the ranks this machine can start."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING, DictConfig

from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Device, Holds, gpu_visible, on_gpu
from stages.common.contract.stage import register_schema, setting
from stages.common.data.chat_prompts import EvalSet, check_eval_sets
from stages.common.drafter.config import check_family
from stages.common.drafter.loss_mask import LossMask
from stages.common.engines.vllm_engine import EngineFeaturesConfig, check_engine, check_mla_target


class Init(str, Enum):
    remap = "remap"  # the remap stage's output: the source drafter with its lm_head rows on the training map
    realign = "realign"  # diagnose's re-aligned drafter: remap, and fc (and embeddings) folded to read the new target
    scratch = "scratch"  # a fresh layer; lm_head rows from the verifier
    as_is = "as_is"  # a drafter trained on another map, unchanged: refused by the guard unless guard.consent=true


class SelectBy(str, Enum):
    val_loss = "val_loss"  # the lowest validation loss, checked every epoch
    accept_len = "accept_len"  # the highest measured accept_len, at every measurement (eval_every > 0)


class Spawn(str, Enum):
    inprocess = "inprocess"  # one rank, in the stage's own process
    torchrun = "torchrun"  # nproc local ranks started by torchrun
    deepspeed = "deepspeed"  # nproc local ranks started by DeepSpeed's own launcher


@dataclass
class DeepSpeedConfig:
    """Engine settings (EAGLE-3's own ds_config: ZeRO-2, betas 0.9/0.95, clipping 0.5); conf/deepspeed/ presets
    choose the ZeRO stage for the pipeline."""

    zero_stage: int = setting(0, at_least=0, at_most=3)
    bf16: Optional[bool] = None  # None: bf16 on GPU, fp32 on CPU
    gradient_accumulation_steps: int = setting(1, at_least=1)
    gradient_clipping: float = setting(0.5, at_least=0)  # 0: no clipping
    warmup_ratio: float = setting(0.015, at_least=0, at_most=1)  # linear warmup over this share of the steps, then cosine to 0 (SpecForge's schedule and 0.015)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = setting(0.0, at_least=0)


@dataclass
class GuardConfig:
    enabled: bool = True
    max_misaligned: float = setting(0.01, at_least=0, at_most=1)  # share of draft positions allowed to point at another token than the map says
    consent: bool = False  # train a misaligned init anyway (to reproduce the failure on purpose)


@dataclass
class AcceptanceConfig:
    """What finetune.eval_every measures: the probe's greedy speculative decoder on the hf target, over a slice of
    each eval set held out from the probe's (conf/wiring ties sets, skip, seed, num_steps and dtype to the probe)."""

    sets: list[EvalSet] = field(default_factory=lambda: [EvalSet("builtin", "builtin")])
    prompts: int = setting(4, at_least=1)  # conversations of each set
    skip: int = setting(8, at_least=0)  # the first this many of each set's seeded order are the probe's
    seed: int = 0  # the probe's shuffle
    max_new_tokens: int = setting(32, at_least=1)
    num_steps: int = setting(3, at_least=1)  # draft tokens per verify step
    dtype: str = "float32"  # the target and drafter while they decode


@dataclass
class FinetuneConfig:
    target: str = MISSING  # target model folder (the verifier)
    target_name: Optional[str] = None  # the hub id the target is deployed by, recorded in the drafter (None: target)
    data: Optional[str] = None  # chat JSONL for the target (online); not needed with `features`
    vocab_map: str = MISSING  # the training draft vocab
    out: str = MISSING
    drafter: Optional[str] = None  # the init's drafter (remap output / source drafter); scratch may omit it
    trust_remote_code: bool = False  # run the code in the target's folder (Kimi's tokenizer and model need it)
    features: Optional[str] = None  # a features stage output: train offline on cached target states
    # online from a vLLM server: the target's states for each batch as it is needed, nothing on disk
    # (engine.enabled; the pipeline's features.mode=online)
    engine: EngineFeaturesConfig = field(default_factory=EngineFeaturesConfig)
    init: Init = Init.remap
    # the drafter a scratch fine-tune builds: eagle3 | eagle3.1 (norm_before_fc, norm_output) | mla | mla3.1 (fc_norm,
    # norm_output) (FAMILY_FLAGS); None: the family of `drafter` (a scratch baseline is its source's), else eagle3
    family: Optional[str] = None
    ttt_steps: int = setting(7, at_least=1)  # SpecForge's length; the Kimi-K2.5 runs used 5, speculators 3
    # TTT loss mask on the assistant mask m, for step k's prediction of token p = t+2+k at position t:
    # drafted: m[t+1..p] all set (what inference drafts: never a turn's first token, never across turns);
    # specforge: m[p-2] (SpecForge 0.2.0, EAGLE-3 cnets.py); speculators: m[p-1] (speculators, SpecForge #895)
    loss_mask: LossMask = LossMask.drafted
    lr: float = setting(1e-4, above=0)
    epochs: int = setting(1, at_least=1)
    max_steps: Optional[int] = setting(None, at_least=1)  # stop after this many optimizer steps
    # end this run at this step with the schedule still max_steps long (a race's rung): checkpoint, validate,
    # export the weights as they are; a later run with a larger stop_at resumes from it as if never stopped
    stop_at: Optional[int] = setting(None, at_least=1)
    micro_batch_size: int = setting(4, at_least=1)
    max_length: int = setting(256, at_least=4)
    val_fraction: float = setting(0.05, at_least=0, below=1)
    log_every: int = setting(10, at_least=1)  # every train metric (lr, grad_norm too) every this many optimizer steps (validation: every epoch)
    # measured accept_len every this many optimizer steps and at the end, and the kept state's (`acceptance`;
    # stages/finetune/acceptance.py); 0: off. It needs a target transformers can hold (the built-in world's)
    eval_every: int = setting(0, at_least=0)
    select_by: SelectBy = SelectBy.val_loss  # the state the stage keeps and exports
    acceptance: AcceptanceConfig = field(default_factory=AcceptanceConfig)
    checkpoint_every: int = setting(100, at_least=1)  # a resumable DeepSpeed checkpoint every this many optimizer steps
    keep_checkpoints: int = setting(2, at_least=0)  # the newest DeepSpeed checkpoints kept (weights + optimizer, ~4x the drafter); 0: all
    checkpoint_dir: Optional[str] = None  # default: <out>.checkpoints
    resume: bool = True  # continue from the latest checkpoint in checkpoint_dir
    seed: int = 0
    # auto: each rank on its own GPU where torch sees one (bf16, NCCL), else the CPU (fp32, gloo); cuda: refuse a
    # machine without a GPU torch can use; cpu: the CPU even on a GPU node
    device: Device = Device.auto
    spawn: Spawn = Spawn.inprocess
    # ranks per node, on `nodes` nodes (launcher=slurm: --nodes, one task per rank; gloo on CPU, NCCL on GPU);
    # nodes x nproc ranks, micro_batch_size and gradient accumulation set the global batch
    nproc: int = setting(1, at_least=1)
    nodes: int = setting(1, at_least=1)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)


def check_ranks(cfg: DictConfig | dict, stage: str = "finetune") -> None:
    """The rank count this machine's spawn mode can start (a job's ranks on Slurm are its tasks instead)."""
    if cfg.get("nodes", 1) != 1:
        raise RegraftError(f"{stage}.nodes={cfg['nodes']}", "this launcher runs a stage on this one machine",
                           "run on Slurm (launcher=slurm), which gives a fine-tune one task per rank across nodes")
    if Spawn(cfg["spawn"]) is Spawn.inprocess and cfg["nproc"] != 1:
        raise RegraftError(f"{stage}.nproc={cfg['nproc']}", "spawn=inprocess runs one rank",
                           f"set {stage}.spawn=torchrun (or deepspeed) for {cfg['nproc']} ranks")
    gpus = cuda_devices() if gpu_visible() else 0
    device = Device(cfg.get("device", Device.auto))
    if device is not Device.cpu and gpu_visible() and not gpus:
        raise RegraftError(f"{stage}.device={device.value}", "this machine has GPUs (/dev/nvidia*) but its torch sees "
                           "none, so the fine-tune would run on the CPU in fp32", "install a CUDA build of torch "
                           f"(docs/scale-out.md, 'A GPU node'), or set {stage}.device=cpu")
    if device is Device.cuda and not gpu_visible():
        raise RegraftError(f"{stage}.device=cuda", "this machine has no GPU",
                           f"run where one is (launcher=slurm), or set {stage}.device=auto")
    if gpus and device is not Device.cpu and cfg["nproc"] > gpus:
        raise RegraftError(f"{stage}.nproc={cfg['nproc']}", f"this machine has {gpus} GPUs, one rank each",
                           f"set {stage}.nproc={gpus}, or run on Slurm (launcher=slurm) across nodes")


def cuda_devices() -> int:
    """The GPUs torch sees here (CUDA_VISIBLE_DEVICES applied); asked only where a GPU device node exists, so a
    check on a CPU machine never imports torch."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def holds(cfg: DictConfig | dict, node_gpus: int) -> Holds:
    """`nproc` ranks on each of `nodes` nodes, a GPU each where the stage computes on GPUs; an online fine-tune's
    vLLM server (started by the stage, not one at engine.server_url) on the same node's GPUs beside them."""
    ranks = int(cfg["nproc"])
    gpus = ranks if on_gpu(cfg.get("device", Device.auto), node_gpus) else 0
    engine, server = cfg.get("engine") or {}, None
    if engine.get("enabled") and not engine.get("server_url"):
        tensor_parallel = int(engine["vllm"]["tensor_parallel_size"])
        server = f"vLLM (online features), tensor-parallel {tensor_parallel}"
        gpus = max(gpus, tensor_parallel) if node_gpus > 0 else gpus
    return Holds(gpus=gpus, nodes=int(cfg.get("nodes", 1)), tasks_per_node=ranks, server=server)


def check_finetune(cfg: DictConfig, where: str) -> None:
    prefix = f"{where}." if where else ""
    check_family(f"{prefix}family", cfg.get("family"))
    if SelectBy(cfg.get("select_by", SelectBy.val_loss)) is SelectBy.accept_len and not cfg.get("eval_every"):
        raise RegraftError(f"{prefix}select_by=accept_len", "keeps the state with the best measured accept_len, and "
                           f"{prefix}eval_every=0 measures none", f"set {prefix}eval_every= to a step count > 0")
    if cfg.get("eval_every"):
        check_eval_sets(cfg.acceptance.sets, f"{prefix}acceptance.sets")
    engine = cfg.get("engine")
    if engine is not None and engine.enabled and not engine.server_url:  # the stage starts the server itself
        check_engine(engine.vllm, f"{where}.engine." if where else "engine.")
        check_vllm_targets(cfg, where)


def check_vllm_targets(cfg: DictConfig, where: str) -> None:
    """No MLA target on the vLLM CPU build of the states server the stage starts itself (features.mode=online;
    vllm_engine.check_mla_target): asked of the stage run alone (check_finetune) and of a pipeline's finetune nodes
    (pipelines/modes/preflight.py). A server at engine.server_url is another's: its build cannot be read here."""
    engine, prefix = cfg.get("engine"), f"{where}." if where else ""
    if engine is not None and engine.enabled and not engine.server_url:
        check_mla_target(engine.vllm, cfg.get("target"), f"{prefix}engine.", "features.mode=offline with "
                         "features.backend=hf (transformers) in a pipeline, engine.enabled=false alone",
                         "the states it trains on")


register_schema("finetune", FinetuneConfig, check=check_finetune)
