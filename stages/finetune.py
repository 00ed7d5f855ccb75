"""finetune stage: EAGLE-3 training-time-test training of a drafter on a new target, on DeepSpeed.

In: the target model folder, chat JSONL, the training vocab map, and the drafter to start from (`init`):
`remap` (the remap stage's output), `scratch` (a fresh layer; lm_head rows from the verifier) or `as_is` (a drafter
trained on another map, used unchanged: the known way to waste a fine-tune, refused by the guard unless consented).
Out: `drafter/` (the best drafter by validation loss, sglang layout, the training map's d2t/t2d), `metrics.jsonl`
(train metrics every `log_every` steps, validation every epoch, preflight), `manifest.json`.
DeepSpeed checkpoints go to `checkpoint_dir` (default `<out>.checkpoints`), so a stopped run resumes from them.

    python -m stages.finetune target=DIR data=FILE vocab_map=MAP drafter=REMAPPED out=DIR ttt_steps=5 lr=1e-4
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Iterator, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from tqdm import tqdm

from stages.common import guard
from stages.common.artifacts import read_manifest, staged_output
from stages.common.chat import load_tokenizer, tokenized_chats
from stages.features import load_features
from stages.common.checkpoint import OUTPUT_OF_LAYER, DrafterCheckpoint, convert_aux_layer_ids
from stages.common.cli import StageResult, register_schema, stage_main
from stages.common.eagle3 import Eagle3Drafter
from stages.common.errors import RegraftError
from stages.common.runtime import free_port
from stages.common.target import TargetHead, TargetModel
from stages.common.toy import drafter_config_for
from stages.common.ttt import TTTStats, ttt_forward, ttt_metrics
from stages.common.verifier import Verifier
from stages.common.vocab import VocabMap, load_vocab_map


class Init(str, Enum):
    remap = "remap"
    scratch = "scratch"
    as_is = "as_is"


class Spawn(str, Enum):
    inprocess = "inprocess"
    torchrun = "torchrun"
    deepspeed = "deepspeed"


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0
    bf16: Optional[bool] = None  # None: bf16 on GPU, fp32 on CPU
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.5
    warmup_ratio: float = 0.015
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0


@dataclass
class GuardConfig:
    enabled: bool = True
    max_misaligned: float = 0.01  # share of draft positions allowed to point at another token than the map says
    consent: bool = False  # train a misaligned init anyway (to reproduce the failure on purpose)


@dataclass
class FinetuneConfig:
    target: str = MISSING  # target model folder (the verifier)
    data: Optional[str] = None  # chat JSONL for the target (online); not needed with `features`
    vocab_map: str = MISSING  # the training draft vocab
    out: str = MISSING
    drafter: Optional[str] = None  # the init's drafter (remap output / source drafter); scratch may omit it
    trust_remote_code: bool = False  # run the code in the target's folder (Kimi's tokenizer and model need it)
    features: Optional[str] = None  # a features stage output: train offline on cached target states
    init: Init = Init.remap
    ttt_steps: int = 7
    lr: float = 1e-4
    epochs: int = 1
    max_steps: Optional[int] = None  # stop after this many optimizer steps
    micro_batch_size: int = 4
    max_length: int = 256
    val_fraction: float = 0.05
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2  # the newest DeepSpeed checkpoints kept (weights + optimizer, ~4x the drafter); 0: all
    checkpoint_dir: Optional[str] = None  # default: <out>.checkpoints
    resume: bool = True  # continue from the latest checkpoint in checkpoint_dir
    seed: int = 0
    spawn: Spawn = Spawn.inprocess
    nproc: int = 1
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)


register_schema("finetune", FinetuneConfig)
RANK_FLAG = "--rank-config"


# ---------------------------------------------------------------- the drafter to start from


def initial_drafter(cfg: DictConfig, training_map: VocabMap) -> tuple[Eagle3Drafter, VocabMap | None]:
    """The init's drafter and the map its lm_head was trained on (None for scratch, which has no past)."""
    init = Init(cfg.init)
    if init is Init.scratch:
        template = DrafterCheckpoint.open(cfg.drafter).config if cfg.drafter else \
            drafter_config_for(cfg.target, training_map.draft_vocab_size)
        config = replace(template, draft_vocab_size=training_map.draft_vocab_size)
        drafter = Eagle3Drafter.initialised(config, training_map, seed=cfg.seed)
        verifier = Verifier.open(cfg.target)
        if verifier.hidden_size == config.hidden_size:
            with torch.no_grad():
                drafter.lm_head.weight.copy_(verifier.lm_head_rows(training_map.target_ids).float())
        return drafter, None
    if not cfg.drafter:
        raise RegraftError(None, f"init={init.value} needs a drafter", "pass drafter=DIR")
    drafter = Eagle3Drafter.from_checkpoint(cfg.drafter, dtype=torch.float32)
    own_map = drafter.vocab_map()
    if own_map.draft_vocab_size != training_map.draft_vocab_size:
        raise RegraftError(cfg.drafter, f"draft vocab of {own_map.draft_vocab_size} ids, the training map has "
                           f"{training_map.draft_vocab_size}", "remap the drafter onto the training map")
    drafter.set_vocab_map(training_map)  # training reads any init through the training map (as_is: unchanged rows)
    return drafter, own_map


def preflight(cfg: DictConfig, drafter: Eagle3Drafter, own_map: VocabMap | None, training_map: VocabMap,
              target: TargetModel, batch: dict[str, torch.Tensor]) -> guard.Preflight:
    """Step-0 numbers of the init on one batch, beside the same drafter remapped; the guard then decides."""
    if own_map is None:
        with torch.no_grad():
            fresh = evaluate_batch(drafter, target, batch, cfg.ttt_steps)
        return guard.Preflight(training_map.draft_vocab_size, training_map.draft_vocab_size,
                               training_map.draft_vocab_size, step0_acc=fresh["full_acc_0"],
                               step0_loss=fresh["loss_0"])
    checked = guard.compare_with_training_map(own_map, training_map)
    trained_on_new_map = guard.remapped_in_memory(drafter, own_map, training_map)
    with torch.no_grad():
        as_given = evaluate_batch(drafter, target, batch, cfg.ttt_steps)
        remapped = evaluate_batch(trained_on_new_map, target, batch, cfg.ttt_steps)
        as_is = remap_source_as_is(cfg, training_map, target, batch)
    result = guard.Preflight(checked.positions_agree, checked.draft_vocab_size, checked.shared_ids,
                             step0_acc=as_given["full_acc_0"], step0_loss=as_given["loss_0"],
                             remapped_step0_acc=remapped["full_acc_0"],
                             as_is_step0_acc=as_is.get("full_acc_0"), as_is_step0_loss=as_is.get("loss_0"))
    if cfg.guard.enabled:
        guard.check(result, Init(cfg.init).value, cfg.guard.max_misaligned, cfg.guard.consent, cfg.drafter)
    return result


def remap_source_as_is(cfg: DictConfig, training_map: VocabMap, target: TargetModel,
                       batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """init=remap from a remap output: the step-0 numbers its source drafter would have had without the remap."""
    manifest = read_manifest(cfg.drafter) if Init(cfg.init) is Init.remap else None
    source = (manifest or {}).get("config", {}).get("drafter")
    if not source or not Path(source).exists():
        return {}
    unmapped = Eagle3Drafter.from_checkpoint(source, dtype=torch.float32)
    if unmapped.config.draft_vocab_size != training_map.draft_vocab_size:
        return {}
    unmapped.set_vocab_map(training_map)
    return evaluate_batch(unmapped, target, batch, cfg.ttt_steps)


def evaluate_batch(drafter: Eagle3Drafter, target: TargetModel, batch: dict[str, torch.Tensor],
                   ttt_steps: int) -> dict[str, float]:
    return run_ttt(drafter, target, batch, ttt_steps).metrics()


def run_ttt(drafter: Eagle3Drafter, target: TargetModel | TargetHead, batch: dict[str, torch.Tensor],
            ttt_steps: int) -> TTTStats:
    """One unrolled pass; `target` runs the target (online) or reads cached states from the batch (offline)."""
    features = target.batch_features(batch)
    return ttt_forward(drafter, target.embed, batch["input_ids"], batch["loss_mask"], features.aux_hidden,
                       features.logits, ttt_steps)


def training_rows(cfg: DictConfig, drafter: Eagle3Drafter) -> tuple[TargetModel | TargetHead, dict]:
    """Online: the whole target and tokenized chats. Offline: the target's embeddings and lm_head only, and the
    cached rows (the same chats in the same order, so both modes see the same batches)."""
    layer_ids = convert_aux_layer_ids(drafter.config.aux_layer_ids, drafter.config.aux_convention, OUTPUT_OF_LAYER)
    if cfg.features:
        return TargetHead(cfg.target), load_features(cfg.features, layer_ids, cfg.max_length)
    if not cfg.data:
        raise RegraftError(None, "finetune needs training data", "pass data=CHATS.jsonl (online) or features=DIR")
    rows = tokenized_chats(load_tokenizer(cfg.target, cfg.trust_remote_code), Path(cfg.data), cfg.max_length)
    return TargetModel.load(cfg.target, layer_ids, OUTPUT_OF_LAYER, trust_remote_code=cfg.trust_remote_code), rows


# ---------------------------------------------------------------- DeepSpeed


def init_distributed(launched: bool, seed: int) -> None:
    """Join the process group: ranks started by a launcher read its env; a lone in-process rank sets its own
    (gloo on CPU) on a free port, whatever a parent process left in the environment."""
    if not launched and not torch.distributed.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(seed)


def deepspeed_config(cfg: DictConfig, total_steps: int) -> dict:
    ds = cfg.deepspeed
    bf16 = torch.cuda.is_available() if ds.bf16 is None else bool(ds.bf16)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": ds.gradient_accumulation_steps,
        "train_batch_size": cfg.micro_batch_size * ds.gradient_accumulation_steps * world,
        "gradient_clipping": ds.gradient_clipping,
        "zero_optimization": {"stage": ds.zero_stage},
        "bf16": {"enabled": bf16},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(total_steps, 1), "warmup_num_steps": max(1, int(ds.warmup_ratio * total_steps))}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


# ---------------------------------------------------------------- data


def split(data: dict[str, torch.Tensor], val_fraction: float, seed: int) -> tuple[dict, dict]:
    count = data["input_ids"].shape[0]
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    val_count = max(1, int(round(val_fraction * count))) if val_fraction > 0 else 0
    pick = lambda rows: {name: tensor[rows] for name, tensor in data.items()}
    return pick(order[val_count:]), pick(order[:val_count])


def micro_batches(data: dict[str, torch.Tensor], size: int, epoch: int, seed: int, rank: int, world: int,
                  skip: int = 0, accumulation: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of one epoch: a seeded shuffle, strided over ranks, whole global batches only
    (so no accumulated gradient spills into the next epoch)."""
    count = data["input_ids"].shape[0]
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    per_step = size * world
    for index in range(skip, count // (per_step * accumulation) * accumulation):
        rows = order[index * per_step + rank * size: index * per_step + (rank + 1) * size]
        yield {name: tensor[rows] for name, tensor in data.items()}


# ---------------------------------------------------------------- the loop


class MetricsLog:
    """metrics.jsonl in the work folder: one line per logged step; a resumed run drops lines past its step."""

    def __init__(self, path: Path, resume_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled and path.exists():
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        elif enabled and resume_step == 0:
            path.write_text("")

    def lines(self) -> int:
        return len(self.path.read_text().splitlines()) if self.enabled and self.path.exists() else 0

    def keep(self, count: int) -> None:
        """Only the first `count` lines: those written before the checkpoint a run resumes from (a validation
        logged after it, at the same step, is run and logged again)."""
        if self.enabled and self.path.exists():
            self.path.write_text("".join(line + "\n" for line in self.path.read_text().splitlines()[:count]))

    def write(self, step: int, split_name: str, metrics: dict[str, float]) -> None:
        if self.enabled:
            with self.path.open("a") as lines:
                lines.write(json.dumps({"step": step, "split": split_name, **metrics}) + "\n")


def validate(drafter: Eagle3Drafter, target: TargetModel, val: dict[str, torch.Tensor], cfg: DictConfig) -> dict:
    """TTT metrics over the whole validation split, from summed counts; `loss` is the decay-weighted total."""
    size = min(cfg.micro_batch_size, val["input_ids"].shape[0])
    sums, batches = None, 0
    with torch.no_grad():
        for batch in micro_batches(val, size, 0, cfg.seed, 0, 1):
            stats = run_ttt(drafter, target, batch, cfg.ttt_steps)
            counts = [stats.step_losses, stats.correct, stats.valid, stats.cond_correct, stats.cond_valid]
            sums = counts if sums is None else [a + b for a, b in zip(sums, counts)]
            batches += 1
    step_losses, *counts = sums
    return ttt_metrics(step_losses / batches, *counts)


class StopSignal:
    """SIGTERM / SIGUSR1 (a scheduler's warning before preemption or the time limit) ask for a clean stop:
    the loop checkpoints at the next optimizer step and ends; rerunning the same command resumes there."""

    def __init__(self):
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._request)

    def _request(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, world: int, device: torch.device) -> bool:
        """Whether any rank was asked to stop: a signal reaches the ranks at different steps, and every rank must
        stop at the same one (saving a checkpoint is collective)."""
        if world == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


class Preempted(RegraftError):
    pass


@dataclass
class Progress:
    """What a checkpoint must carry besides weights and optimizer so a resumed run continues exactly."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # micro-batches of this epoch already consumed
    best_val_loss: float = float("inf")
    logged: Optional[int] = None  # lines of metrics.jsonl when the checkpoint was saved (rank 0's)


def train(cfg: DictConfig, drafter: Eagle3Drafter, target: TargetModel, train_data: dict, val_data: dict,
          work: Path, log: MetricsLog, progress: Progress) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    import deepspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    accumulation = cfg.deepspeed.gradient_accumulation_steps
    per_epoch = train_data["input_ids"].shape[0] // (cfg.micro_batch_size * world) // accumulation
    if per_epoch == 0:
        raise RegraftError(cfg.data, "fewer conversations than one global batch", "lower micro_batch_size or add data")
    total_steps = min(per_epoch * cfg.epochs, cfg.max_steps or per_epoch * cfg.epochs)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.deepspeed.betas),
                                  weight_decay=cfg.deepspeed.weight_decay)
    engine, _, _, scheduler = deepspeed.initialize(model=drafter, optimizer=optimizer,
                                                   config=deepspeed_config(cfg, total_steps))
    checkpoints, best_file = work / "deepspeed", work / "best.pt"
    if cfg.resume and (checkpoints / "latest").exists():
        _, client_state = engine.load_checkpoint(str(checkpoints))
        progress = Progress(**client_state["progress"])
        if progress.logged is not None:
            log.keep(progress.logged)
        if rank == 0:
            print(f"finetune: resumed at step {progress.step} of {total_steps} from {checkpoints}", file=sys.stderr,
                  flush=True)
    best = torch.load(best_file, weights_only=True) if cfg.resume and best_file.exists() else \
        {"state": snapshot(engine.module), "val": {}}
    stop = StopSignal()

    def save_checkpoint() -> None:
        """`latest` is written once every rank has written its part (DeepSpeed's own is written by rank 0 before
        the others may be done), so a job killed while saving resumes from the checkpoint before."""
        progress.logged = log.lines()
        tag = f"step{progress.step}"
        engine.save_checkpoint(str(checkpoints), tag=tag, client_state={"progress": vars(progress)},
                               save_latest=False)  # returns after a barrier
        if rank == 0:
            (checkpoints / "latest.tmp").write_text(tag)
            os.replace(checkpoints / "latest.tmp", checkpoints / "latest")
            prune_checkpoints(checkpoints, cfg.keep_checkpoints)

    bar = tqdm(total=total_steps, initial=progress.step, desc="finetune", disable=rank != 0, mininterval=1.0)
    started, tokens = time.perf_counter(), 0
    while progress.step < total_steps and progress.epoch < cfg.epochs:
        for batch in micro_batches(train_data, cfg.micro_batch_size, progress.epoch, cfg.seed, rank, world,
                                   skip=progress.batch, accumulation=accumulation):
            stats = run_ttt(engine.module, target, batch, cfg.ttt_steps)
            engine.backward(stats.loss)
            engine.step()
            progress.batch += 1
            tokens += int(batch["attention_mask"].sum())
            if progress.batch % accumulation:
                continue
            progress.step += 1
            bar.update(1)
            if progress.step % cfg.log_every == 0 or progress.step == total_steps:
                elapsed = time.perf_counter() - started
                log.write(progress.step, "train", {**stats.metrics(),
                                                   "lr": scheduler.get_last_lr()[0],
                                                   "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                                                   "tokens_per_s": tokens * world / max(elapsed, 1e-9)})
            stopping = stop.agreed(world, engine.device)
            if progress.step % cfg.checkpoint_every == 0 or stopping:
                save_checkpoint()
            if stopping:
                raise Preempted(checkpoints, f"stopped by a signal at step {progress.step} of {total_steps}; "
                                "checkpoint saved", "rerun the same command to resume (resume=true)")
            if progress.step >= total_steps:
                break
        else:
            progress.epoch, progress.batch = progress.epoch + 1, 0
        val = validate(engine.module, target, val_data, cfg) if val_data["input_ids"].numel() else {}
        if val:
            log.write(progress.step, "val", val)
        if not val or val["loss"] < progress.best_val_loss:
            progress.best_val_loss = val.get("loss", progress.best_val_loss)
            best = {"state": snapshot(engine.module), "val": val}
            if rank == 0:  # a job killed while saving leaves the previous best whole
                torch.save(best, best_file.with_suffix(".tmp"))
                os.replace(best_file.with_suffix(".tmp"), best_file)
        if progress.step >= total_steps:
            break
    bar.close()
    return best["state"], best["val"]


def prune_checkpoints(checkpoints: Path, keep: int) -> None:
    """Keep the `keep` newest DeepSpeed checkpoints (`step<N>` folders) up to the one `latest` names; delete the
    older ones. A folder past `latest` (a save cut short before a resume) is left for the next save to overwrite.
    keep=0 keeps every checkpoint."""
    newest = int((checkpoints / "latest").read_text().removeprefix("step"))
    steps = sorted(int(path.name[4:]) for path in checkpoints.glob("step*")
                   if path.is_dir() and path.name[4:].isdigit() and int(path.name[4:]) <= newest)
    for step in steps[:-keep] if keep else []:
        shutil.rmtree(checkpoints / f"step{step}", ignore_errors=True)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full copy of the weights; under ZeRO-3 the partitioned parameters are gathered first (on every rank)."""
    import deepspeed

    params = list(module.parameters())
    partitioned = any(hasattr(param, "ds_id") for param in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None) if partitioned else contextlib.nullcontext():
        return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def launcher_command(spawn: Spawn, nproc: int, config_file: Path) -> list[str]:
    """torchrun or DeepSpeed's own launcher, each starting `nproc` local ranks of this module."""
    port = str(free_port())
    if spawn is Spawn.torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", port,
                "-m", "stages.finetune", RANK_FLAG, str(config_file)]
    # --no_local_rank: the ranks read LOCAL_RANK from the environment, as under torchrun
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", port, "--no_local_rank",
            "--module", "stages.finetune", RANK_FLAG, str(config_file)]


def launch_ranks(cfg: DictConfig) -> StageResult:
    """Start `nproc` ranks with torchrun or `deepspeed` on this stage's resolved config; rank 0 writes."""
    spawn = Spawn(cfg.spawn)
    work = Path(cfg.checkpoint_dir or f"{cfg.out}.checkpoints")
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / "rank_config.yaml"
    OmegaConf.save(cfg, config_file, resolve=True)
    done = subprocess.run(launcher_command(spawn, cfg.nproc, config_file.absolute()),
                          cwd=Path(__file__).resolve().parents[1])
    manifest = read_manifest(cfg.out)
    if done.returncode != 0 or manifest is None:
        raise RegraftError(work, f"{cfg.nproc} {spawn.value} ranks ended with exit code {done.returncode}",
                           "read the ranks' output above; rerun to resume from the last checkpoint")
    return StageResult(Path(cfg.out), manifest["metrics"], manifest.get("headline", ""))


def run(cfg: DictConfig) -> StageResult:
    spawn = Spawn(cfg.spawn)
    if spawn is not Spawn.inprocess:
        return launch_ranks(cfg)
    if cfg.nproc != 1:
        raise RegraftError(None, "spawn=inprocess runs one rank",
                           "use finetune.spawn=torchrun or spawn=deepspeed for nproc > 1")
    return run_rank(cfg, launched=False)


def run_rank(cfg: DictConfig, launched: bool) -> StageResult:
    """The training itself, on this process's rank (a launcher's, or a lone in-process one)."""
    init_distributed(launched, cfg.seed)
    rank = int(os.environ["RANK"])
    training_map = load_vocab_map(cfg.vocab_map)
    drafter, own_map = initial_drafter(cfg, training_map)
    target, rows = training_rows(cfg, drafter)
    train_data, val_data = split(rows, cfg.val_fraction, cfg.seed)
    first = next(micro_batches(train_data, cfg.micro_batch_size, 0, cfg.seed, 0, 1))
    checked = preflight(cfg, drafter, own_map, training_map, target, first)
    work = Path(cfg.checkpoint_dir or f"{cfg.out}.checkpoints")
    work.mkdir(parents=True, exist_ok=True)
    resumed = cfg.resume and (work / "deepspeed" / "latest").exists()
    log = MetricsLog(work / "metrics.jsonl", resume_step=resumed_step(work) if resumed else 0, enabled=rank == 0)
    if not resumed:
        log.write(0, "preflight", checked.metrics())
    best_state, best_val = train(cfg, drafter, target, train_data, val_data, work, log, Progress())
    metrics = {**checked.metrics(), **{f"val_{k}": v for k, v in best_val.items()}}
    headline = (f"init={Init(cfg.init).value}: best val loss {best_val.get('loss', float('nan')):.3f}, "
                f"full_acc_0 {best_val.get('full_acc_0', float('nan')):.3f}, "
                f"sim_accept_len {best_val.get('sim_accept_len', float('nan')):.2f}")
    if rank == 0:
        with torch.device("meta"):
            best = Eagle3Drafter(drafter.config)  # a plain module: the engine's may hold ZeRO-3 partitions
        best.load_state_dict(best_state, assign=True)
        with staged_output(cfg.out, "finetune", cfg) as staged:
            best.save(staged.path / "drafter", layout="sglang")
            (staged.path / "metrics.jsonl").write_text((work / "metrics.jsonl").read_text())
            staged.update(metrics=metrics, checkpoint_dir=str(work.absolute()), headline=headline)
    return StageResult(Path(cfg.out), metrics, headline)


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


if __name__ == "__main__":
    if sys.argv[1:2] == [RANK_FLAG]:
        raise SystemExit(rank_main(sys.argv[2]))
    raise SystemExit(stage_main("finetune", run))
