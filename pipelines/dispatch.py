"""Where stage jobs run: `launcher=local` (submitit's local executor, the default), `launcher=slurm` (submitit on
Slurm, stages chained with afterok dependencies) or `launcher=inline` (this process, for debugging).

Every launcher runs `pipelines.jobs.run_stage` and hands back submitit-like jobs; the orchestrator asks each one
`finished(job)` and `outcome(job)`. Local jobs start only once their inputs exist (the local executor has no
queue); Slurm jobs are all submitted at once and wait in Slurm's queue on their upstream jobs.
"""
from __future__ import annotations

import sys
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

    def __init__(self, cfg: DictConfig, folder: Path):
        self.cfg, self.folder = cfg, folder

    def resources(self, node: Node) -> dict[str, Any]:
        """Per-stage overrides from `launcher.per_stage.<node name>` over `launcher.resources`."""
        merged = OmegaConf.merge(self.cfg.resources, self.cfg.per_stage.get(node.name) or {})
        return OmegaConf.to_container(merged, resolve=True)

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
    def executor(self, node: Node, after: list[Any]):
        import submitit

        executor = submitit.LocalExecutor(folder=self.folder / "%j", python=sys.executable)
        resources = self.resources(node)
        executor.update_parameters(timeout_min=resources.get("timeout_min", 24 * 60))
        return executor


class SlurmLauncher(SubmititLauncher):
    chains = True

    def executor(self, node: Node, after: list[Any]):
        import submitit

        resources = self.resources(node)
        executor = submitit.AutoExecutor(folder=self.folder / "%j", cluster="slurm")
        extra = dict(resources.pop("additional_parameters", None) or {})
        if after:
            extra["dependency"] = "afterok:" + ":".join(job.job_id for job in after)
        executor.update_parameters(name=f"regraft-{node.name}", slurm_additional_parameters=extra,
                                   **{key: value for key, value in resources.items() if value is not None})
        return executor

    def finished(self, job) -> bool:
        from pipelines.slurm_jobs import ACTIVE, job_state

        return job_state(job) not in ACTIVE

    def outcome(self, job) -> StageOutcome:
        from pipelines.slurm_jobs import wait_for

        return wait_for([job])[0]

    def cancel(self, job) -> None:
        import subprocess

        subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)


LAUNCHERS = {"inline": InlineLauncher, "local": LocalLauncher, "slurm": SlurmLauncher}


def make_launcher(cfg: DictConfig, folder: Path) -> Launcher:
    return LAUNCHERS[cfg.name](cfg, folder)
