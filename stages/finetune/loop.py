"""The finetune's training loop on a DeepSpeed engine: batches, the TTT step, validation, checkpoints, signals.

`train` runs optimizer steps until the schedule ends, validating every epoch and keeping the best state by
validation loss; it checkpoints every `checkpoint_every` steps (and when SIGTERM/SIGUSR1 ask it to stop), and a run
with `resume` continues from the latest checkpoint to the same weights as an uninterrupted one. Data comes through
a row source (`stages.common.data.feature_shards.Rows`: chats in memory, cached features streamed from disk, or a
vLLM server's states, read ahead by `engine.prefetch` batches), one micro-batch at a time; all give the same seeded
split and batches.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR
from omegaconf import DictConfig
from tqdm import tqdm

from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.data.feature_shards import Rows, RowSubset, as_rows
from stages.common.drafter.target import TargetHead, TargetModel
from stages.common.drafter.ttt import LossMask, TTTStats, draft_vocab_ids, ttt_forward, ttt_metrics
from stages.finetune.acceptance import EVAL, AcceptanceProbe
from stages.finetune.prefetch import read_ahead
from stages.schemas.finetune import SelectBy


def device_of(module: torch.nn.Module) -> torch.device:
    """Where a module computes (DeepSpeed's engine puts the drafter on `cuda:LOCAL_RANK`)."""
    return next(module.parameters()).device


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch where the drafter computes; from pinned host memory (`pinned`) the copy runs asynchronously."""
    if all(tensor.device == device for tensor in batch.values()):
        return batch
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def pinned(batches: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """Each batch in page-locked host memory (in the read-ahead thread), so its copy to a GPU can overlap compute."""
    for batch in batches:
        yield {name: tensor.pin_memory() for name, tensor in batch.items()}


def run_ttt(drafter: Eagle3Drafter, target: TargetModel | TargetHead, batch: dict[str, torch.Tensor],
            ttt_steps: int, loss_mask: LossMask | str = LossMask.drafted) -> TTTStats:
    """One unrolled pass where the drafter is: the batch is moved there, the target (or its head) must be there
    already. `target` runs the target (online) or reads cached states from the batch (offline), and gives the
    full-vocab argmax and the draft-vocab logits once per batch; `loss_mask` picks the TTT loss mask."""
    batch = to_device(batch, device_of(drafter))
    features = target.batch_features(batch, draft_ids=draft_vocab_ids(drafter))
    return ttt_forward(drafter, target.embed, batch["input_ids"], batch["loss_mask"], features.aux_hidden,
                       features.signals, ttt_steps, loss_mask)


# ---------------------------------------------------------------- DeepSpeed


def uses_bf16(cfg: DictConfig, device: torch.device) -> bool:
    """deepspeed.bf16, where set; else bf16 on a GPU and fp32 on the CPU."""
    return device.type == "cuda" if cfg.deepspeed.bf16 is None else bool(cfg.deepspeed.bf16)


def deepspeed_config(cfg: DictConfig, total_steps: int, device: torch.device) -> dict:
    ds = cfg.deepspeed
    bf16 = uses_bf16(cfg, device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": ds.gradient_accumulation_steps,
        "train_batch_size": cfg.micro_batch_size * ds.gradient_accumulation_steps * world,
        "gradient_clipping": ds.gradient_clipping,
        "zero_optimization": {"stage": ds.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """SpecForge's count (specforge/optimizer.py): `int(warmup_ratio * total_steps)`, zero for a short run."""
    return int(warmup_ratio * total_steps)


def lr_factor(step: int, total_steps: int, warmup: int) -> float:
    """The share of the peak lr that optimizer step `step + 1` uses: SpecForge 0.2.0's CosineAnnealingWarmupLR,
    linear `(step + 1) / warmup` over the warmup, then a half cosine from the peak to 0 over the rest. (DeepSpeed's
    WarmupCosineLR warms up on a log curve from 0, so its first steps train at lr 0.)"""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


def lr_schedule(cfg: DictConfig, total_steps: int) -> Callable[[torch.optim.Optimizer], LambdaLR]:
    """What deepspeed.initialize builds the scheduler with, on the optimizer it wraps; its state goes into
    DeepSpeed's checkpoints, so a resumed run goes on from the step it stopped at."""
    warmup = warmup_steps(total_steps, cfg.deepspeed.warmup_ratio)
    return lambda optimizer: LambdaLR(optimizer, functools.partial(lr_factor, total_steps=total_steps, warmup=warmup))


# ---------------------------------------------------------------- data


def split(data: Rows | dict[str, torch.Tensor], val_fraction: float, seed: int) -> tuple[Rows, Rows]:
    """A seeded train/validation split, as views of the rows (nothing is read)."""
    rows = as_rows(data)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    val_count = max(1, int(round(val_fraction * len(rows)))) if val_fraction > 0 else 0
    return RowSubset(rows, order[val_count:]), RowSubset(rows, order[:val_count])


def micro_batches(data: Rows | dict[str, torch.Tensor], size: int, epoch: int, seed: int, rank: int, world: int,
                  skip: int = 0, accumulation: int = 1, stop: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of one epoch, from the `skip`-th to before the `stop`-th: a seeded shuffle, strided
    over ranks, whole global batches only (so no accumulated gradient spills into the next epoch); each is read
    when it is asked for, and none past `stop` (a run's last step), which a read-ahead would otherwise ask for."""
    rows = as_rows(data)
    count = len(rows)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    per_step = size * world
    whole = count // (per_step * accumulation) * accumulation
    for index in range(skip, whole if stop is None else min(stop, whole)):
        yield rows.take(order[index * per_step + rank * size: index * per_step + (rank + 1) * size])


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


GPU_READ_AHEAD = 2  # cached batches read (and pinned) ahead of a GPU trainer, so a shard read never stalls a step


def read_ahead_window(cfg: DictConfig, device: torch.device) -> int:
    """Batches read ahead of the trainer: the engine's prefetch when a server computes them; on a GPU, a few cached
    ones; on the CPU none (a reading thread would compete with the training for the same cores)."""
    engine = cfg.get("engine")
    if engine is not None and engine.enabled:
        return int(engine.prefetch)
    return GPU_READ_AHEAD if device.type == "cuda" else 0


def batches_for(batches: Iterator[dict[str, torch.Tensor]], cfg: DictConfig, device: torch.device,
                waits: list[float] | None) -> Iterator[dict[str, torch.Tensor]]:
    """`batches` as the trainer on `device` takes them: read ahead, and pinned for a GPU."""
    if device.type == "cuda":
        batches = pinned(batches)
    return read_ahead(batches, read_ahead_window(cfg, device), waits)


def validation_batches(val: Rows, size: int, seed: int, rank: int, world: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's share of the validation batches: the batches one rank alone would take, dealt out in turn, so
    the figures do not depend on the rank count (up to the order of a float sum) and no rank reads another's."""
    whole = len(val) // size
    order = torch.randperm(len(val), generator=torch.Generator().manual_seed(seed * 1000))
    for index in range(rank, whole, world):
        yield val.take(order[index * size:(index + 1) * size])


def validate(drafter: Eagle3Drafter, target: TargetModel, val: Rows, cfg: DictConfig,
             waits: list[float] | None = None) -> dict:
    """TTT metrics over the whole validation split, each rank on its share, from counts summed over the ranks;
    `loss` is the decay-weighted total."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device, size = device_of(drafter), min(cfg.micro_batch_size, len(val))
    sums, batches = None, 0
    with torch.no_grad():
        for batch in batches_for(validation_batches(val, size, cfg.seed, rank, world), cfg, device, waits):
            stats = run_ttt(drafter, target, batch, cfg.ttt_steps, cfg.loss_mask)
            counts = [stats.step_losses, stats.correct, stats.valid, stats.cond_correct, stats.cond_valid]
            sums = counts if sums is None else [a + b for a, b in zip(sums, counts)]
            batches += 1
    if world > 1:
        sums, batches = summed_over_ranks(sums, batches, cfg.ttt_steps, device)
    step_losses, *counts = sums
    return ttt_metrics(step_losses / batches, *counts)


def summed_over_ranks(sums: list[torch.Tensor] | None, batches: int, steps: int,
                      device: torch.device) -> tuple[list[torch.Tensor], int]:
    """Every rank's validation sums and batch count added up (a rank without a batch adds zeros)."""
    parts = [torch.zeros(steps, device=device) for _ in range(5)] if sums is None else sums
    packed = torch.cat([part.double().reshape(-1) for part in parts] + [torch.tensor([float(batches)], device=device,
                                                                                     dtype=torch.float64)])
    torch.distributed.all_reduce(packed)
    return list(packed[:-1].reshape(5, steps)), int(packed[-1].item())


class StopSignal:
    """SIGTERM / SIGUSR1 (a scheduler's warning before preemption) and SIGUSR2 (Slurm's warning before the time
    limit, which submitit asks for) ask for a clean stop: the loop checkpoints at the next optimizer step and ends;
    rerunning the same command resumes there. SIGUSR2's own handler (submitit's: requeue the job, then exit) runs
    after that checkpoint (`after_checkpoint`), so a requeued job resumes at the step it stopped at, not at the last
    periodic checkpoint up to `checkpoint_every` steps before."""

    def __init__(self):
        self.requested = False
        self.time_limit_handler = None  # set once SIGUSR2 came: the handler it had before this one
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._request)
            self.previous_usr2 = signal.signal(signal.SIGUSR2, self._time_limit)

    def _request(self, signum, frame) -> None:
        self.requested = True

    def _time_limit(self, signum, frame) -> None:
        self.requested = True
        self.time_limit_handler = self.previous_usr2

    def after_checkpoint(self) -> None:
        """What SIGUSR2 would have done (submitit: requeue and exit), now that the checkpoint is saved."""
        if callable(self.time_limit_handler):
            self.time_limit_handler(signal.SIGUSR2, None)

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
    best_accept_len: float = float("-inf")  # of the kept state, with select_by=accept_len
    logged: Optional[int] = None  # lines of metrics.jsonl when the checkpoint was saved (rank 0's)
    validated: int = 0  # the step of the last validation (a checkpoint is taken before the validation after it)
    measured: int = 0  # the step of the last acceptance measurement (eval_every)


def train(cfg: DictConfig, drafter: Eagle3Drafter, target: TargetModel, train_data: Rows, val_data: Rows,
          work: Path, log: MetricsLog, progress: Progress,
          waits: list[float] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, float]]:
    """The state the run keeps (finetune.select_by), its validation figures and its measured acceptance (empty
    without eval_every); `waits` collects the seconds the trainer waited for batches read ahead (online: the
    server's share of the wall time it could not hide)."""
    import deepspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    accumulation = cfg.deepspeed.gradient_accumulation_steps
    per_epoch = len(train_data) // (cfg.micro_batch_size * world) // accumulation
    if per_epoch == 0:
        raise RegraftError(cfg.data, "fewer conversations than one global batch", "lower micro_batch_size or add data")
    scheduled = per_epoch * cfg.epochs
    total_steps = scheduled if cfg.max_steps is None else min(scheduled, cfg.max_steps)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.deepspeed.betas),
                                  weight_decay=cfg.deepspeed.weight_decay)
    device = device_of(drafter)
    engine, _, _, scheduler = deepspeed.initialize(model=drafter, optimizer=optimizer,
                                                   lr_scheduler=lr_schedule(cfg, total_steps),
                                                   config=deepspeed_config(cfg, total_steps, device))
    checkpoints, best_file = work / "deepspeed", work / "best.pt"
    if cfg.resume and (checkpoints / "latest").exists():
        _, client_state = engine.load_checkpoint(str(checkpoints))
        progress = Progress(**client_state["progress"])
        if progress.logged is not None:
            log.keep(progress.logged)
        if rank == 0:
            print(f"finetune: resumed at step {progress.step} of {total_steps} from {checkpoints}", file=sys.stderr,
                  flush=True)
    keeps = rank == 0  # the rank that exports: the others hold no copy of the best weights
    best = torch.load(best_file, map_location="cpu", weights_only=True) if cfg.resume and best_file.exists() else \
        {"state": snapshot(engine.module, keeps), "val": {}, "eval": {}, "step": progress.step}
    probe = AcceptanceProbe(cfg, device) if cfg.eval_every and rank == 0 else None
    by_acceptance = SelectBy(cfg.select_by) is SelectBy.accept_len
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

    def measured(state: dict[str, torch.Tensor] | None = None, step: int | None = None) -> dict[str, float]:
        """accept_len of the weights as they are now, or of a kept `state` from `step` (rank 0 decodes, every rank
        gets its figures), logged at the step the weights are from."""
        if state is None:  # on every rank: gathering partitioned weights is collective
            state, step = snapshot(engine.module, keeps), progress.step
        figures = [probe.measure(state, engine.module.config) if probe is not None else None]
        if world > 1:
            torch.distributed.broadcast_object_list(figures, src=0)
        progress.measured = max(progress.measured, step)
        log.write(step, EVAL, figures[0])
        return figures[0]

    def assess(best: dict, validating: bool) -> dict:
        """The weights as they are now: validated at `validating` points (every epoch; at every measurement when the
        kept state is chosen by acceptance), their acceptance measured where eval_every asks (its cadence and the
        last step); they become the kept state if they beat it by select_by (the lowest validation loss, or the
        highest accept_len)."""
        due = bool(cfg.eval_every) and progress.measured < progress.step and \
            (progress.step % cfg.eval_every == 0 or progress.step >= total_steps)
        val = {}
        if validating or (by_acceptance and due and progress.validated < progress.step):
            val = validate(engine.module, target, val_data, cfg, waits) if len(val_data) else {}
            progress.validated = progress.step
            if val:
                log.write(progress.step, "val", val)
        accepted = measured() if due else {}
        if by_acceptance:
            better = bool(accepted) and accepted["accept_len"] > progress.best_accept_len
        else:
            better = validating and (not val or val["loss"] < progress.best_val_loss)
        if better:
            progress.best_val_loss = val.get("loss", progress.best_val_loss)
            progress.best_accept_len = accepted.get("accept_len", progress.best_accept_len)
            best = {"state": snapshot(engine.module, keeps), "val": val, "eval": accepted, "step": progress.step}
            if rank == 0:  # a job killed while saving leaves the previous best whole
                torch.save(best, best_file.with_suffix(".tmp"))
                os.replace(best_file.with_suffix(".tmp"), best_file)
        return best

    def kept_measured(best: dict) -> dict:
        """The kept state with its acceptance: measured now if it was kept at a step without a measurement (by val
        loss, between two measurements)."""
        if cfg.eval_every and not best.get("eval"):
            best = {**best, "eval": measured(best["state"], best.get("step", 0))}
        return best

    end = total_steps if cfg.stop_at is None else min(cfg.stop_at, total_steps)
    if progress.step > end:
        raise RegraftError(checkpoints, f"the checkpoint is at step {progress.step}, past stop_at={end}",
                           "give this run its own checkpoint_dir, or a later stop_at")
    bar = tqdm(total=end, initial=progress.step, desc="finetune", disable=rank != 0, mininterval=1.0)
    started, tokens = time.perf_counter(), 0
    while progress.step < end and progress.epoch < cfg.epochs:
        for batch in batches_for(micro_batches(train_data, cfg.micro_batch_size, progress.epoch, cfg.seed, rank,
                                               world, skip=progress.batch, accumulation=accumulation,
                                               stop=progress.batch + (end - progress.step) * accumulation),
                                 cfg, device, waits):
            stats = run_ttt(engine.module, target, batch, cfg.ttt_steps, cfg.loss_mask)
            engine.backward(stats.loss)
            lr, grad_norm = optimizer_step(engine, scheduler)
            progress.batch += 1
            tokens += int(batch["attention_mask"].sum())
            if progress.batch % accumulation:
                continue
            progress.step += 1
            bar.update(1)
            # every train series at the same steps (log_every=1 shows a warmup step by step), so that a loss point
            # has its rate and gradient norm beside it
            if progress.step % cfg.log_every == 0 or progress.step == total_steps:
                elapsed = time.perf_counter() - started
                log.write(progress.step, "train", {"lr": lr, "grad_norm": grad_norm, **stats.metrics(),
                                                   "tokens_per_s": tokens * world / max(elapsed, 1e-9)})
            stopping = stop.agreed(world, engine.device)
            if progress.step % cfg.checkpoint_every == 0 or stopping:
                save_checkpoint()
            if stopping:
                stop.after_checkpoint()
                raise Preempted(checkpoints, f"stopped by a signal at step {progress.step} of {total_steps}; "
                                "checkpoint saved", "rerun the same command to resume (resume=true)")
            if cfg.eval_every and progress.step % cfg.eval_every == 0 and progress.step < end:
                best = assess(best, validating=False)
            if progress.step >= end:
                break
        else:
            progress.epoch, progress.batch = progress.epoch + 1, 0
        if progress.step >= end and end < total_steps:
            return rung_stop(cfg, engine, target, val_data, save_checkpoint, bar, keeps)
        best = assess(best, validating=True)
        if progress.step >= total_steps:
            break
    # resumed from the checkpoint of the last step, which is taken before that step's validation
    if progress.step >= end and end < total_steps:
        return rung_stop(cfg, engine, target, val_data, save_checkpoint, bar, keeps)
    if progress.step >= total_steps and progress.validated < progress.step:
        best = assess(best, validating=True)
    bar.close()
    best = kept_measured(best)
    return best["state"], best["val"], best.get("eval", {})


def rung_stop(cfg: DictConfig, engine, target: TargetModel, val_data: Rows, save_checkpoint,
              bar, keeps: bool) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, float]]:
    """`stop_at` reached before the schedule's end (a race's rung): a checkpoint the next rung resumes from, taken
    before this validation, so neither the log nor the best state a continued run keeps ever sees it (it runs on
    exactly as an uninterrupted one); the weights as they are now and their validation."""
    save_checkpoint()
    bar.close()
    return snapshot(engine.module, keeps), validate(engine.module, target, val_data, cfg) if len(val_data) else {}, {}


def optimizer_step(engine, scheduler) -> tuple[float, float | None]:
    """`engine.step()`, and what that optimizer step used: its learning rate (read before the scheduler moves on)
    and the global gradient norm clipping saw, before clipping, at every ZeRO stage: DeepSpeed reports it where its
    own optimizer wrapper computes it (ZeRO 1-3, bf16), and under ZeRO-0 fp32 it clips the gradients on the
    parameters, whose norm is taken here first. Both are None-free only at an accumulation boundary."""
    # the optimizer's own rate: the scheduler's `get_last_lr` is not restored with a checkpoint (0 after a resume)
    lr = engine.optimizer.param_groups[0]["lr"]
    local = None
    if engine.is_gradient_accumulation_boundary():
        grads = [param.grad for param in engine.module.parameters() if param.grad is not None]
        local = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))) \
            if grads else None
    engine.step()
    reported = engine.get_global_grad_norm()
    norm = float(reported) if reported is not None else local
    return float(lr), norm


def prune_checkpoints(checkpoints: Path, keep: int) -> None:
    """Keep the `keep` newest DeepSpeed checkpoints (`step<N>` folders) up to the one `latest` names; delete the
    older ones. A folder past `latest` (a save cut short before a resume) is left for the next save to overwrite.
    keep=0 keeps every checkpoint."""
    newest = int((checkpoints / "latest").read_text().removeprefix("step"))
    steps = sorted(int(path.name[4:]) for path in checkpoints.glob("step*")
                   if path.is_dir() and path.name[4:].isdigit() and int(path.name[4:]) <= newest)
    for step in steps[:-keep] if keep else []:
        shutil.rmtree(checkpoints / f"step{step}", ignore_errors=True)


def snapshot(module: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """A full copy of the weights in host memory (none where `keep` is false: a rank that does not export); under
    ZeRO-3 the partitioned parameters are gathered first, on every rank, as the gather is collective."""
    import deepspeed

    params = list(module.parameters())
    partitioned = any(hasattr(param, "ds_id") for param in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None) if partitioned else contextlib.nullcontext():
        if not keep:
            return {}
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}
