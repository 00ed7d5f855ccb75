"""What a dispatched job runs: one stage on its resolved config, under the stage's lock.

Submitit pickles `run_stage` by reference, so a job needs nothing but this repository on its path. The job checks
the cache again under the lock: a sweep member that started the same stage first leaves a complete output, and
this one reports a hit instead of running it twice.

Locally, a job whose stage holds GPUs runs `OnGpus`: the stage with CUDA_VISIBLE_DEVICES set to the GPUs its
job was given. On Slurm two more shapes exist (pipelines/launch/slurm.py picks them):
- `run_ranks`: one task of a multi-task job (`tasks_per_node` > 1) is one rank of a `RankedStage` (finetune).
  Only rank 0 takes the lock and
  looks at the cache, then tells the other ranks over a gloo group; only rank 0 writes the output.
- `Resumable`: wraps either for a stage that continues from its own checkpoints (`resume: true`). Submitit calls
  its `checkpoint()` on the time-limit warning (USR2) and requeues the same call; a stage stopped by SIGTERM (a
  preemption or `scontrol requeue`) leaves no result file, so Slurm's requeue runs it again and it resumes.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pipelines.core.cache import is_complete, stage_lock, sweep_leftovers
from pipelines.core.registry import schema_module, stage_module
from stages.common.contract.artifacts import read_manifest
from stages.common.contract.errors import RegraftError, disk_full
from stages.common.contract.runtime import set_process_defaults


@runtime_checkable
class RankedStage(Protocol):
    """A stage module that runs as several ranks of one job (and may be stopped to resume later)."""

    Preempted: type[BaseException]  # raised after a signal asked it to stop and it saved a checkpoint

    def init_distributed(self, launched: bool, seed: int, device: str) -> Any: ...  # joins; returns its device

    def check_ranks(self, cfg: Any, stage: str) -> None: ...  # the ranks this machine can start (RegraftError)

    def run_rank(self, cfg: Any, launched: bool) -> Any: ...


@dataclass
class StageOutcome:
    out: str
    hit: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    headline: str = ""
    seconds: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)  # of the packages that made it (manifest)
    engine_versions: dict[str, str] = field(default_factory=dict)  # of the engine's interpreter, if one ran
    engine_python: str = ""  # that interpreter


def stage_config(stage: str, config: dict[str, Any]):
    """The stage's schema merged with the config, so a job re-checks every key and type it was handed."""
    module = stage_module(stage)
    schema_module(stage)  # registers it
    schema = ConfigStore.instance().load(f"schema/{stage}.yaml").node
    return module, OmegaConf.merge(schema, config)


# The line a failing stage leaves in its job's log for the orchestrator to show: the stage's own one-line error.
STAGE_ERROR = "regraft: stage failed: "


class StageFailed(RegraftError):
    """A stage that ended without a result: its own one-line error (`line`), where its full log is, and its node."""

    def __init__(self, line: str, log: str | Path | None, node: str = ""):
        Exception.__init__(self, line)
        self.path, self.problem, self.fix = None if log is None else str(log), line, None
        self.line, self.log, self.node = line, self.path, node


def error_line(stage: str, exc: BaseException) -> str:
    """One line for the terminal: a RegraftError's own; anything else named as the crash it is."""
    if isinstance(exc, RegraftError):
        return str(exc)
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return (f"the {stage} stage crashed: {type(exc).__name__}: {first} (no check of regraft's caught this input; "
            "the traceback in the log is the place to start, and a report helps)")


@contextlib.contextmanager
def reporting_failure(stage: str, out: Path) -> Iterator[None]:
    """Leave the stage's error line in the job's log (stderr) on the way out, for `reported_error` to find.

    A write that filled the disk (`out`: the folder the stage was writing) becomes the full-disk line, raised as
    such; a log on that full disk may not take even the line, which is then given up, not raised over the error.
    """
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        full = disk_full(exc, out)
        # on a line of its own: a progress bar leaves the cursor mid-line
        with contextlib.suppress(OSError):
            print("\n" + STAGE_ERROR + error_line(stage, full or exc), file=sys.stderr, flush=True)
        if full is not None and full is not exc:
            raise full from exc
        raise


def reported_error(log: str | Path | None) -> str | None:
    """The error line a stage left in its log, the last one if several (None: it left none, e.g. it was killed)."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines() if log else []
    except OSError:
        return None
    found = [line[len(STAGE_ERROR):].strip() for line in lines if line.startswith(STAGE_ERROR)]
    return found[-1] if found else None


def outcome_from_manifest(out: Path, hit: bool, seconds: float) -> StageOutcome:
    manifest = read_manifest(out) or {}
    return StageOutcome(str(out), hit, manifest.get("metrics", {}), manifest.get("headline", ""), seconds,
                        manifest.get("versions", {}), manifest.get("engine_versions", {}),
                        manifest.get("engine_python", ""))


def run_stage(stage: str, config: dict[str, Any]) -> StageOutcome:
    set_process_defaults()
    out = Path(config["out"])
    with reporting_failure(stage, out), stage_lock(out):
        if is_complete(out):
            return outcome_from_manifest(out, hit=True, seconds=0.0)
        sweep_leftovers(out)
        module, cfg = stage_config(stage, config)
        start = time.perf_counter()
        result = module.run(cfg)
        seconds = time.perf_counter() - start
    return StageOutcome(str(out), False, dict(result.metrics), result.headline, seconds)


@dataclass(frozen=True)
class OnGpus:
    """A local job's function, run with CUDA_VISIBLE_DEVICES set to the GPU ids the launcher gave its job, before
    anything starts CUDA (an engine the stage starts inherits them). submitit's local executor sets the variable
    empty, and its own `visible_gpus` takes integers only, where an id may be a GPU's UUID."""

    function: Callable[[str, dict[str, Any]], StageOutcome]
    gpus: tuple[str, ...]

    def __call__(self, stage: str, config: dict[str, Any]) -> StageOutcome:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return self.function(stage, config)


# A submitter's leftovers: sbatch exports the submitting environment into the job, and a rank must take its own.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_ranks(stage: str, config: dict[str, Any]) -> StageOutcome:
    """One task of a multi-task Slurm job as one rank of the stage; every task returns the same outcome.

    Rank 0 holds the stage's lock for the whole run (the job's claim against other jobs); the other ranks never
    touch it, so no rank waits on a lock another rank of its own job holds. The hit-or-run decision is rank 0's,
    broadcast once the process group exists, so every rank takes the same branch. While rank 0 waits for a lock
    another job holds, the other ranks wait in that broadcast (torch's process-group timeout, 30 min by default).
    """
    with reporting_failure(stage, Path(config["out"])):
        return rank_of_job(stage, config)


def rank_of_job(stage: str, config: dict[str, Any]) -> StageOutcome:
    import submitit
    import torch

    set_process_defaults()
    for name in RANK_VARIABLES:
        os.environ.pop(name, None)
    # MASTER_PORT from the job id: the same on every task (and on a requeued run of the job)
    ranks = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    if os.environ.get("SLURM_CPUS_PER_TASK"):  # no oversubscription where Slurm does not bind tasks to cores
        torch.set_num_threads(int(os.environ["SLURM_CPUS_PER_TASK"]))
    module, cfg = stage_config(stage, config)
    if not isinstance(module, RankedStage):
        raise RegraftError(None, f"stage {stage} runs as one task, this job has {ranks.world_size}",
                           f"drop tasks_per_node for {stage} from launcher.per_stage and launcher.per_node")
    module.init_distributed(True, cfg.seed, cfg.device)
    decide = torch.distributed.new_group(backend="gloo")  # CPU objects, whatever the training backend
    out, leader = Path(config["out"]), ranks.rank == 0
    with stage_lock(out) if leader else contextlib.nullcontext():
        hit = [is_complete(out) if leader else None]
        if leader and not hit[0]:
            sweep_leftovers(out)
        torch.distributed.broadcast_object_list(hit, src=0, group=decide)
        if hit[0]:
            return outcome_from_manifest(out, hit=True, seconds=0.0)
        start = time.perf_counter()
        result = module.run_rank(cfg, launched=True)
        seconds = time.perf_counter() - start
    return StageOutcome(str(out), False, dict(result.metrics), result.headline, seconds)


def resumable(config: dict[str, Any]) -> bool:
    """A stage that continues from its own checkpoints when run again (finetune with resume=true)."""
    return config.get("resume") is True


class Resumable:
    """A Slurm job function for a resumable stage: worth requeueing when the job is stopped before the end.

    `checkpoint` is submitit's hook, called on the time-limit warning (`--signal=USR2@signal_delay_s`): it
    resubmits the same call and submitit requeues the job (at most `max_num_timeout` times for time limits); the
    stage then resumes from its last checkpoint, losing at most `checkpoint_every` steps. A stage stopped by
    SIGTERM (preemption, `scontrol requeue`, `scancel`) checkpoints and raises its `Preempted`; that becomes an
    exit without a result file, so a requeued job is not mistaken for a failed one, and a cancelled job reads
    CANCELLED.
    """

    def __init__(self, function):
        self.function = function

    def __call__(self, stage: str, config: dict[str, Any]) -> StageOutcome:
        module = stage_module(stage)
        stopped = module.Preempted if isinstance(module, RankedStage) else ()
        try:
            return self.function(stage, config)
        except stopped as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    def checkpoint(self, stage: str, config: dict[str, Any]):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, stage, config)
