"""finetune stage: EAGLE-3 training-time-test training of a drafter on a new target, on DeepSpeed.

In: the target model folder, chat JSONL (online: tokenized into memory) or a features stage output (offline:
streamed from its shards a micro-batch at a time, so memory does not grow with the data), the training vocab map,
and the drafter to start from (`init`):
`remap` (the remap stage's output), `scratch` (a fresh layer; lm_head rows from the verifier) or `as_is` (a drafter
trained on another map, used unchanged: the known way to waste a fine-tune, refused by the guard unless consented).
Out: `drafter/` (the best drafter by validation loss, sglang layout, the training map's d2t/t2d), `metrics.jsonl`
(every train metric, lr and grad norm included, every `log_every` steps and at the last, validation every
epoch, preflight), `manifest.json`.
DeepSpeed checkpoints go to `checkpoint_dir` (default `<out>.checkpoints`), so a stopped run resumes from them.
The preflight guard is `guard.py`, the training loop `loop.py`.

    python -m stages.finetune target=DIR data=FILE vocab_map=MAP drafter=REMAPPED out=DIR ttt_steps=5 lr=1e-4
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from stages.common.contract.artifacts import read_manifest, staged_output
from stages.common.data.chat import load_tokenizer, tokenized_chats
from stages.common.drafter.checkpoint import DrafterCheckpoint
from stages.common.drafter.config import (OUTPUT_OF_LAYER, DrafterConfig, check_drafter_fits_target,
                                          convert_aux_layer_ids, drafter_config_for, target_config)
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.data.feature_shards import Rows, TensorRows, open_features
from stages.common.contract.runtime import free_port
from stages.common.engines.vllm_states import EngineRows, EngineStates
from stages.common.contract.stage import StageResult
from stages.common.drafter.target import TargetHead, TargetModel
from stages.common.drafter.verifier import Verifier
from stages.common.drafter.vocab import VocabMap, load_vocab_map
from stages.common.contract.hardware import Device
from stages.finetune.device import deepspeed_devices, node_states_server, training_device
from stages.finetune.acceptance import EVAL
from stages.finetune.guard import PREFLIGHT, checked_once
from stages.finetune.loop import MetricsLog, Preempted, Progress, split, train, uses_bf16
from stages.finetune.op_builds import take_over_stale_build_locks
from stages.schemas.finetune import FinetuneConfig, Init, SelectBy, Spawn, check_ranks

__all__ = ["FinetuneConfig", "Preempted", "check_ranks", "init_distributed", "run", "run_rank"]  # what pipelines/core/jobs.py calls
RANK_FLAG = "--rank-config"


# ---------------------------------------------------------------- the drafter to start from


def check_map_fits_target(cfg: DictConfig, training_map: VocabMap) -> None:
    vocab = Verifier.open(cfg.target).vocab_size
    if training_map.vocab_size != vocab:
        raise RegraftError(cfg.vocab_map, f"map is over a vocab of {training_map.vocab_size} ids, the target "
                           f"({cfg.target}) has {vocab}", "build the map with the target's tokenizer (vocab_map stage)")


def scratch_config(cfg: DictConfig, draft_vocab_size: int) -> DrafterConfig:
    """A scratch drafter's config: the init drafter's (its family, sizes, aux layers) unless `family` asks for
    another; a fresh one for the target without a drafter."""
    if cfg.drafter:
        template = DrafterCheckpoint.open(cfg.drafter).config
        if cfg.get("family") in (None, template.family):
            return replace(template, draft_vocab_size=draft_vocab_size)
    return drafter_config_for(cfg.target, draft_vocab_size, family=cfg.get("family") or "eagle3")


def initial_drafter(cfg: DictConfig, training_map: VocabMap) -> tuple[Eagle3Drafter, VocabMap | None]:
    """The init's drafter and the map its lm_head was trained on (None for scratch, which has no past)."""
    init = Init(cfg.init)
    if init is Init.scratch:
        config = scratch_config(cfg, training_map.draft_vocab_size)
        drafter = Eagle3Drafter.initialised(config, training_map, seed=cfg.seed)
        verifier = Verifier.open(cfg.target)
        if verifier.hidden_size == config.hidden_size:
            with torch.no_grad():
                drafter.lm_head.weight.copy_(verifier.lm_head_rows(training_map.target_ids).float())
        return drafter, None
    if not cfg.drafter:
        raise RegraftError(None, f"init={init.value} needs a drafter", "pass drafter=DIR")
    checkpoint = DrafterCheckpoint.open(cfg.drafter)
    check_drafter_fits_target(checkpoint.config, target_config(cfg.target), cfg.drafter, cfg.target)
    drafter = Eagle3Drafter.from_checkpoint(checkpoint, dtype=torch.float32)
    own_map = drafter.vocab_map()
    if own_map.draft_vocab_size != training_map.draft_vocab_size:
        raise RegraftError(cfg.drafter, f"draft vocab of {own_map.draft_vocab_size} ids, the training map has "
                           f"{training_map.draft_vocab_size}", "remap the drafter onto the training map")
    drafter.set_vocab_map(training_map)  # training reads any init through the training map (as_is: unchanged rows)
    return drafter, own_map


def training_rows(cfg: DictConfig, drafter: Eagle3Drafter,
                  device: torch.device) -> tuple[TargetModel | TargetHead, Rows]:
    """Online: the whole target and tokenized chats, in memory. Offline: the target's embeddings and lm_head only,
    and the cached rows streamed from their shards a batch at a time (the same chats in the same order, so both
    modes see the same batches). The target (or its head) is put where the drafter trains, in the drafter's
    precision on a GPU (the target's states come as a bf16 engine computed them) and in fp32 on the CPU."""
    layer_ids = aux_layers_of(drafter)
    dtype = torch.bfloat16 if device.type == "cuda" and uses_bf16(cfg, device) else torch.float32
    if cfg.features:
        return TargetHead(cfg.target, device, dtype), open_features(cfg.features, layer_ids, cfg.max_length)
    if not cfg.data:
        raise RegraftError(None, "finetune needs training data", "pass data=CHATS.jsonl (online) or features=DIR")
    rows = tokenized_chats(load_tokenizer(cfg.target, cfg.trust_remote_code), Path(cfg.data), cfg.max_length)
    if cfg.engine.enabled:
        states = EngineStates(cfg.engine.server_url, cfg.target, layer_ids, cfg.engine.retries,
                              cfg.engine.request_timeout_s)
        return TargetHead(cfg.target, device, dtype), EngineRows(rows, states)
    target = TargetModel.load(cfg.target, layer_ids, OUTPUT_OF_LAYER, dtype=dtype,
                              trust_remote_code=cfg.trust_remote_code)
    return target.to(device), TensorRows(rows)


def aux_layers_of(drafter: Eagle3Drafter | DrafterConfig) -> list[int]:
    config = drafter.config if isinstance(drafter, Eagle3Drafter) else drafter
    return convert_aux_layer_ids(config.aux_layer_ids, config.aux_convention, OUTPUT_OF_LAYER)


# ---------------------------------------------------------------- DeepSpeed


def use_built_cpu_ops(device: torch.device | None = None) -> None:
    """On CPU, DeepSpeed JIT-builds its shared-memory all-reduce op (`deepspeed_shm_comm`) when the first process
    group starts: 35-70 s, more under load, into a cache keyed by the interpreter's path, so every new checkout or
    venv paid it at its first fine-tune. Here the op lives in this venv (`<venv>/torch_extensions`), built once at
    install (`make venv` runs `build_cpu_ops`). `device`: where the ranks train (None: the CPU unless torch sees a
    GPU); a CPU run on a GPU node tells DeepSpeed so, which would otherwise take the GPU accelerator."""
    if (device.type == "cpu") if device is not None else not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def build_cpu_ops() -> None:
    """Build DeepSpeed's CPU ops regraft uses into this venv now (install time), not at the first fine-tune."""
    use_built_cpu_ops()
    if not torch.cuda.is_available():
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()


def init_distributed(launched: bool, seed: int, device: Device | str = Device.auto) -> torch.device:
    """Join the process group and return this rank's device (`training_device`): ranks started by a launcher read
    its env; a lone in-process rank sets its own on a free port, whatever a parent process left in the environment.
    NCCL between GPUs (each rank's current device set first, as NCCL needs), gloo on the CPU."""
    if not launched and not torch.distributed.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank_device = training_device(device)
    if rank_device.type == "cuda":
        torch.cuda.set_device(rank_device)
    use_built_cpu_ops(rank_device)
    take_over_stale_build_locks()  # before the first op load, which would wait on a killed build's lock forever
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if rank_device.type == "cuda" else "gloo")
    torch.manual_seed(seed)
    return rank_device


def launcher_command(spawn: Spawn, nproc: int, config_file: Path, device: Device | str = Device.auto) -> list[str]:
    """torchrun or DeepSpeed's own launcher, each starting `nproc` local ranks of this module (torchrun's ranks
    index the GPUs CUDA_VISIBLE_DEVICES gives; DeepSpeed's are named: `deepspeed_devices`)."""
    port = str(free_port())
    if spawn is Spawn.torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", port,
                "-m", "stages.finetune", RANK_FLAG, str(config_file)]
    # --no_local_rank: the ranks read LOCAL_RANK from the environment, as under torchrun
    return [sys.executable, "-m", "deepspeed.launcher.runner", *deepspeed_devices(nproc, device),
            "--master_addr", "127.0.0.1", "--master_port", port, "--no_local_rank",
            "--module", "stages.finetune", RANK_FLAG, str(config_file)]


def launch_ranks(cfg: DictConfig) -> StageResult:
    """Start `nproc` ranks with torchrun or `deepspeed` on this stage's resolved config; rank 0 writes."""
    spawn = Spawn(cfg.spawn)
    work = Path(cfg.checkpoint_dir or f"{cfg.out}.checkpoints")
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / "rank_config.yaml"
    OmegaConf.save(cfg, config_file, resolve=True)
    done = subprocess.run(launcher_command(spawn, cfg.nproc, config_file.absolute(), cfg.device),
                          cwd=Path(__file__).resolve().parents[2])
    manifest = read_manifest(cfg.out)
    if done.returncode != 0 or manifest is None:
        raise RegraftError(work, f"{cfg.nproc} {spawn.value} ranks ended with exit code {done.returncode}",
                           "read the ranks' output above; rerun to resume from the last checkpoint")
    return StageResult(Path(cfg.out), manifest["metrics"], manifest.get("headline", ""))


def run(cfg: DictConfig) -> StageResult:
    check_ranks(cfg)
    if Spawn(cfg.spawn) is Spawn.inprocess:
        return run_rank(cfg, launched=False)
    # online: one server for all the ranks this process starts (unless engine.server_url names one), up for the stage
    with node_states_server(cfg, work_dir(cfg)) as served:
        return launch_ranks(served)


def work_dir(cfg: DictConfig) -> Path:
    """The run's checkpoints, metrics, rank config and server logs."""
    return Path(cfg.checkpoint_dir or f"{cfg.out}.checkpoints")


def initial_config(cfg: DictConfig) -> DrafterConfig:
    """The config of the drafter this run trains (its aux layers: what a server must capture), without weights."""
    if Init(cfg.init) is Init.scratch:
        return scratch_config(cfg, load_vocab_map(cfg.vocab_map).draft_vocab_size)
    if not cfg.drafter:
        raise RegraftError(None, f"init={Init(cfg.init).value} needs a drafter", "pass drafter=DIR")
    return DrafterCheckpoint.open(cfg.drafter).config


def run_rank(cfg: DictConfig, launched: bool) -> StageResult:
    """The training itself, on this process's rank (a launcher's, or a lone in-process one), on its device; online
    without a server URL, each node's first rank starts the server its node's ranks read (on Slurm too)."""
    device = init_distributed(launched, cfg.seed, cfg.device)
    work = work_dir(cfg)
    work.mkdir(parents=True, exist_ok=True)
    with node_states_server(cfg, work) as served:
        return train_rank(served, device, work)


def train_rank(cfg: DictConfig, device: torch.device, work: Path) -> StageResult:
    rank = int(os.environ["RANK"])
    training_map = load_vocab_map(cfg.vocab_map)
    check_map_fits_target(cfg, training_map)
    drafter, own_map = initial_drafter(cfg, training_map)
    drafter.to(device)
    target, rows = training_rows(cfg, drafter, device)
    try:
        train_data, val_data = split(rows, cfg.val_fraction, cfg.seed)
        resumed = cfg.resume and (work / "deepspeed" / "latest").exists()
        checked = checked_once(cfg, drafter, own_map, training_map, target, train_data, work if resumed else None)
        log = MetricsLog(work / "metrics.jsonl", resume_step=resumed_step(work) if resumed else 0, enabled=rank == 0)
        if not resumed:
            log.write(0, PREFLIGHT, checked)
        waits: list[float] = []
        best_state, best_val, best_eval = train(cfg, drafter, target, train_data, val_data, work, log, Progress(),
                                                waits)
    finally:  # the engine's request threads end with the training, however it ends
        if isinstance(rows, EngineRows):
            rows.states.close()
    metrics = {**checked, **{f"val_{k}": v for k, v in best_val.items()}, **engine_metrics(rows, waits),
               **acceptance_metrics(best_eval, work)}
    headline = (f"{drafter.config.describe()}, init={Init(cfg.init).value}: best val loss {best_val.get('loss', float('nan')):.3f}, "
                f"full_acc_0 {best_val.get('full_acc_0', float('nan')):.3f}, "
                f"sim_accept_len {best_val.get('sim_accept_len', float('nan')):.2f}")
    if best_eval:
        headline += f", measured accept_len {best_eval['accept_len']:.3f}"
    if cfg.select_by == SelectBy.accept_len:
        headline = headline.replace("best val loss", "val loss") + " (kept: the best measured accept_len)"
    if rank == 0:
        with torch.device("meta"):
            # a plain module (the engine's may hold ZeRO-3 partitions) that names the target it was trained for
            best = Eagle3Drafter(drafter.config.with_verifier(cfg.target, cfg.target_name))
        best.load_state_dict(best_state, assign=True)
        with staged_output(cfg.out, "finetune", cfg) as staged:
            best.save(staged.path / "drafter", layout="sglang")
            (staged.path / "metrics.jsonl").write_text((work / "metrics.jsonl").read_text())
            staged.update(metrics=metrics, checkpoint_dir=str(work.absolute()), headline=headline,
                          device=device_name(device), precision="bf16" if uses_bf16(cfg, device) else "fp32")
    return StageResult(Path(cfg.out), metrics, headline)


def acceptance_metrics(kept: dict[str, float], work: Path) -> dict[str, float]:
    """The kept state's measured acceptance (`eval_accept_len`, `eval_accept_len/<set>`) and the seconds every
    measurement of the run took together (`eval_seconds`); nothing without eval_every."""
    measured = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["split"] == EVAL] if (work / "metrics.jsonl").exists() else []
    if not measured:
        return {}
    figures = {f"eval_{key}": value for key, value in kept.items() if key != "seconds"}
    return {**figures, "eval_seconds_total": sum(line["seconds"] for line in measured),
            "eval_measurements": len(measured)}


def device_name(device: torch.device) -> str:
    """`cuda:0 (NVIDIA B200)`, or `cpu`: what the manifest records the ranks trained on."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def engine_metrics(rows: Rows, waits: list[float]) -> dict[str, float]:
    """Online: the rows the server computed states for, its seconds doing so, and the trainer's wait for them."""
    if not isinstance(rows, EngineRows):
        return {}
    return {"engine_rows": rows.states.rows, "engine_seconds": rows.states.seconds, "engine_wait_seconds": sum(waits)}


def resumed_step(work: Path) -> int:
    tag = (work / "deepspeed" / "latest").read_text().strip()
    return int(tag.removeprefix("step"))


def rank_main(config_file: str) -> int:
    """One torchrun rank: the launcher's resolved config, checked against the schema again."""
    cfg = OmegaConf.merge(OmegaConf.structured(FinetuneConfig), OmegaConf.load(config_file))
    try:
        run_rank(cfg, launched=True)
    except RegraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
