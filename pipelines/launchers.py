"""Where stage jobs run: `launcher=local` (submitit's local executor, the default), `launcher=slurm` (submitit on
Slurm, stages chained with afterok dependencies) or `launcher=inline` (this process, for debugging).

Every launcher runs `pipelines.jobs.run_stage` and hands back submitit-like jobs; the orchestrator asks each one
`finished(job)` and `outcome(job)`. Local jobs start only once their inputs exist (the local executor has no
queue); Slurm jobs are all submitted at once and wait in Slurm's queue on their upstream jobs.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipelines.dag import Node
from pipelines.jobs import StageOutcome, run_stage
from stages.common.errors import RegraftError


@dataclass
class InlineJob:
    """A stage already run in this process: the result, or the exception it raised."""

    job_id: str
    result_value: StageOutcome | None = None
    error: BaseException | None = None

    def done(self) -> bool:
        return True


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class Launcher:
    chains = False  # True: submits jobs whose inputs do not exist yet, with scheduler dependencies
    in_process = False  # True: submit runs the stage itself

    def __init__(self, cfg: DictConfig, folder: Path):
        self.cfg, self.folder = cfg, folder

    def resources(self, node: Node) -> dict[str, Any]:
        """`launcher.per_stage.<node name>` over `launcher.resources`; both are resolved first, while their
        interpolations (slurm's `${finetune.nproc}`) can still reach the root config."""
        overrides = self.cfg.per_stage.get(node.name)
        return OmegaConf.to_container(OmegaConf.merge(
            OmegaConf.to_container(self.cfg.resources, resolve=True),
            OmegaConf.to_container(overrides, resolve=True) if overrides else {}))

    def prepare(self, nodes: list[Node]) -> None:
        """Called once before dispatching, with the nodes that will (probably) run."""

    def submit(self, node: Node, config: DictConfig, after: list[Any]) -> Any:
        raise NotImplementedError

    def finished(self, job: Any) -> bool:
        return job.done()

    def outcome(self, job: Any) -> StageOutcome:
        raise NotImplementedError

    def cancel(self, job: Any) -> None:
        pass

    def log_of(self, job: Any) -> str:
        paths = getattr(job, "paths", None)
        return str(paths.stderr) if paths is not None else ""


class InlineLauncher(Launcher):
    in_process = True

    def submit(self, node: Node, config: DictConfig, after: list[Any]) -> InlineJob:
        job = InlineJob(job_id=f"inline-{node.name}")
        try:
            job.result_value = run_stage(node.stage, OmegaConf.to_container(config))
        except RegraftError as exc:
            job.error = exc
        return job

    def outcome(self, job: InlineJob) -> StageOutcome:
        if job.error is not None:
            raise job.error
        return job.result_value


class SubmititLauncher(Launcher):
    """Shared by the local and Slurm launchers: an executor, and failures read from the job's own log."""

    def executor(self, node: Node, after: list[Any]):
        raise NotImplementedError

    def submit(self, node: Node, config: DictConfig, after: list[Any]):
        executor = self.executor(node, after)
        return executor.submit(run_stage, node.stage, OmegaConf.to_container(config))

    def outcome(self, job) -> StageOutcome:
        import submitit

        try:
            return job.result()
        except submitit.core.utils.FailedJobError as exc:
            raise RegraftError(job.paths.stderr, f"stage job {job.job_id} failed: {last_line(str(exc))}",
                               "read the job's log; rerun to resume from what completed") from None

    def cancel(self, job) -> None:
        job.cancel(check=False)


class LocalLauncher(SubmititLauncher):
    """submitit's local executor; with `warm: true` its jobs fork from one interpreter that imported torch and
    the stages once (pipelines/warm.py) instead of each importing them again (~4 s a job on 2 cores)."""

    def __init__(self, cfg: DictConfig, folder: Path):
        super().__init__(cfg, folder)
        self.warm = None

    def prepare(self, nodes: list[Node]) -> None:
        if nodes and self.cfg.get("warm", False):
            from pipelines.warm import shared_interpreter

            self.warm = shared_interpreter(sorted({f"stages.{node.stage}" for node in nodes}),
                                           self.folder / "warm.log")

    def executor(self, node: Node, after: list[Any]):
        import submitit

        python = self.warm.python() if self.warm is not None else shlex.quote(sys.executable)
        executor = submitit.LocalExecutor(folder=self.folder / "%j", python=python)
        resources = self.resources(node)
        executor.update_parameters(timeout_min=resources.get("timeout_min", 24 * 60))
        return executor


class SlurmLauncher(SubmititLauncher):
    """One Slurm job per stage through submitit, each submitted with `afterok` on its upstream jobs.

    A stage with `tasks_per_node` (x `nodes`) > 1 runs as that many ranks (`pipelines.jobs.run_ranks`); the rank
    count changes the global batch, so it must equal the stage's `nproc`, which is part of its cache key.
    Resumable stages (finetune) are submitted `--requeue` and checkpointable (`pipelines.jobs.Resumable`).
    Every submission is recorded in `<run>/jobs/submitted.jsonl` (node, job id, upstream ids, Slurm's
    `Dependency=` read back right after sbatch).
    """

    chains = True

    def __init__(self, cfg: DictConfig, folder: Path):
        super().__init__(cfg, folder)
        self.watching: set[str] = set()  # job ids not yet seen finished
        self.known: dict[str, Any] = {}  # one squeue answer for all of them, refreshed once per poll
        self.polled = 0.0

    def executor(self, node: Node, after: list[Any], resources: dict[str, Any] | None = None):
        import submitit

        resources = dict(resources or self.resources(node))
        executor = submitit.AutoExecutor(folder=self.folder / "%j", cluster="slurm",
                                         slurm_python=self.cfg.get("python") or None,
                                         slurm_max_num_timeout=self.cfg.get("max_num_timeout", 3))
        extra = dict(resources.pop("additional_parameters", None) or {})
        if after:
            extra["dependency"] = "afterok:" + ":".join(job.job_id for job in after)
        executor.update_parameters(name=f"regraft-{node.name}", slurm_additional_parameters=extra,
                                   **{key: value for key, value in resources.items() if value is not None})
        return executor

    def submit(self, node: Node, config: DictConfig, after: list[Any]):
        from pipelines.jobs import Resumable, resumable, run_ranks
        from pipelines.slurm_jobs import dependency_of

        resources = self.resources(node)
        tasks = int(resources.get("tasks_per_node") or 1) * int(resources.get("nodes") or 1)
        plain = OmegaConf.to_container(config)
        if tasks > 1 and "nproc" not in plain:
            raise RegraftError(None, f"{node.name} runs as one task, launcher.per_stage gives it {tasks}",
                               f"set launcher.per_stage.{node.name}.tasks_per_node=1")
        if tasks > 1 and plain["nproc"] != tasks:
            raise RegraftError(None, f"{node.name} would run as {tasks} Slurm tasks (ranks) but {node.stage}.nproc="
                               f"{plain['nproc']}; the rank count sets the global batch and belongs in the cache key",
                               f"set {node.stage}.nproc={tasks}")
        function = run_ranks if tasks > 1 else run_stage
        if resumable(plain):
            function = Resumable(function)
            resources["additional_parameters"] = {"requeue": True, **(resources.get("additional_parameters") or {})}
        job = self.executor(node, after, resources).submit(function, node.stage, plain)
        self.watching.add(job.job_id)
        record = {"node": node.name, "stage": node.stage, "job_id": job.job_id, "tasks": tasks,
                  "after": [upstream.job_id for upstream in after], "dependency": dependency_of(job.job_id)}
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / "submitted.jsonl").open("a") as lines:
            lines.write(json.dumps(record) + "\n")
        return job

    def finished(self, job) -> bool:
        from pipelines.slurm_jobs import ACTIVE, _squeue, job_info

        if time.monotonic() - self.polled > self.cfg.poll_s / 2:
            self.known = _squeue(sorted(self.watching)) if self.watching else {}
            self.polled = time.monotonic()
        done = job_info(job, self.known).state not in ACTIVE
        if done:
            self.watching.discard(job.job_id)
        return done

    def outcome(self, job) -> StageOutcome:
        from pipelines.slurm_jobs import wait_for

        result = wait_for([job])[0]
        return result[0] if isinstance(result, list) else result  # a multi-task job: rank 0's

    def cancel(self, job) -> None:
        import subprocess

        subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)


LAUNCHERS = {"inline": InlineLauncher, "local": LocalLauncher, "slurm": SlurmLauncher}


def make_launcher(cfg: DictConfig, folder: Path) -> Launcher:
    return LAUNCHERS[cfg.name](cfg, folder)
