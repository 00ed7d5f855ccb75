"""`launcher=inline`: each stage run in this process, inside `submit` (for debugging: a breakpoint in a stage stops
there, and Ctrl-C reaches it)."""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipelines.core.dag import Node
from pipelines.core.jobs import StageFailed, StageOutcome, error_line, run_stage
from pipelines.launch.base import Launcher


@dataclass
class InlineJob:
    """A stage already run in this process: the result, or the exception it raised (its traceback in `log`)."""

    job_id: str
    stage: str
    log: Path
    result_value: StageOutcome | None = None
    error: BaseException | None = None

    def done(self) -> bool:
        return True



class InlineLauncher(Launcher):
    in_process = True

    def submit(self, node: Node, config: DictConfig, after: list[Any]) -> InlineJob:
        job = InlineJob(f"inline-{node.name}", node.stage, self.folder / f"inline-{node.name}.log")
        try:
            job.result_value = run_stage(node.stage, OmegaConf.to_container(config))
        except Exception as exc:  # Ctrl-C and exits go on up
            job.error = exc
            job.log.parent.mkdir(parents=True, exist_ok=True)
            job.log.write_text("".join(traceback.format_exception(exc)))
        return job

    def outcome(self, job: InlineJob) -> StageOutcome:
        if job.error is not None:
            raise StageFailed(error_line(job.stage, job.error), job.log)
        return job.result_value

    def log_of(self, job: InlineJob) -> str:
        return str(job.log)
