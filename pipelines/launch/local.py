"""`launcher=local` (the default): each stage a process started by submitit's local executor on this machine, when
its inputs exist and the GPUs it holds are free; with `launcher.warm` forked from one warm interpreter (warm/)."""
from __future__ import annotations

import contextlib
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from pipelines.core.dag import Node
from pipelines.core.jobs import OnGpus, StageOutcome, resumable, run_stage
from pipelines.core.registry import entry
from pipelines.launch.base import SubmititLauncher
from pipelines.launch.node_gpus import GpuPool


class LocalLauncher(SubmititLauncher):
    """submitit's local executor; with `warm: true` its jobs fork from one interpreter that imported torch and
    the stages once (pipelines/launch/warm/server.py) instead of each importing them again (~4 s a job on 2 cores).

    Jobs are started with SIGINT ignored, so the terminal's Ctrl-C reaches regraft alone (a job's controller would
    print a KeyboardInterrupt traceback); regraft cancels them with SIGTERM, which submitit's controller forwards to
    the stage: a fine-tune saves a checkpoint and stops, anything else ends at once. `stop` waits for them.

    A job whose stage holds GPUs (or that per_stage/per_node give `gpus_per_node`) gets that many of the node's ids,
    none held by a running job, as its CUDA_VISIBLE_DEVICES, and starts only once they are free (`can_start`); a job
    that holds none runs beside any other, with no GPU visible (submitit's local executor sets CUDA_VISIBLE_DEVICES
    empty).
    """

    def __init__(self, cfg: DictConfig, folder: Path):
        super().__init__(cfg, folder)
        self.warm = None
        self.resumable: dict[str, bool] = {}  # by job id: a stage that saves and stops on SIGTERM
        self.pool: GpuPool | None = None

    def gpu_pool(self) -> GpuPool:
        if self.pool is None:
            self.check_machine(planning=False)  # launcher.node_gpus is no more than this machine shows
            self.pool = GpuPool(self.node_gpus().ids)
        return self.pool

    def can_start(self, node: Node) -> bool:
        """When the GPUs the node holds are free; one that needs more than the node has is refused, not waited on."""
        wanted = self.gpus_asked(node)
        if not wanted:
            return True
        self.check_gpus(node)
        return len(self.gpu_pool().free()) >= wanted

    def prepare(self, nodes: list[Node]) -> None:
        if nodes and self.cfg.get("warm", False):
            from pipelines.launch.warm.server import shared_interpreter

            self.warm = shared_interpreter(sorted({entry(node.stage).module for node in nodes}),
                                           self.folder / "warm.log")

    def executor(self, node: Node, after: list[Any]):
        import submitit

        python = self.warm.python() if self.warm is not None else shlex.quote(sys.executable)
        executor = submitit.LocalExecutor(folder=self.folder / node.name, python=python)  # %j: an empty "%j" folder
        resources = self.resources(node)
        executor.update_parameters(timeout_min=resources.get("timeout_min", 24 * 60))
        return executor

    def function(self, node: Node) -> Callable[[str, dict[str, Any]], StageOutcome]:
        """What the node's job calls with its stage and config (a test may record what a job was given instead)."""
        return run_stage

    def submit(self, node: Node, config: DictConfig, after: list[Any]):
        wanted = self.gpus_asked(node)
        gpus = tuple(self.gpu_pool().free()[:wanted]) if wanted else ()
        function = self.function(node)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the job's controller and tasks
        try:
            job = self.executor(node, after).submit(OnGpus(function, gpus) if gpus else function, node.stage,
                                                    OmegaConf.to_container(config))
        finally:
            signal.signal(signal.SIGINT, previous)
        if gpus:
            self.gpu_pool().hold(job, gpus)
        self.resumable[job.job_id] = resumable(OmegaConf.to_container(config))
        return job

    def cancel(self, job) -> None:
        """SIGTERM, forwarded by submitit's controller to the stage: a fine-tune saves a checkpoint at its next step
        and stops; submitit's job wrapper lets other stages run on (it ignores SIGTERM), so `stop` ends them."""
        process = getattr(job, "_process", None)  # the job's controller
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)

    def stop(self, jobs: list[Any], grace_s: float) -> None:
        """Give a cancelled resumable stage up to `grace_s` to save and end, any other a few seconds; then kill what
        is left of each job (its controller and every process under it)."""
        import psutil

        started = time.monotonic()
        for job in jobs:
            process = getattr(job, "_process", None)
            if process is None:
                continue
            patience = grace_s if self.resumable.get(job.job_id) else min(grace_s, 3.0)
            try:
                process.wait(timeout=max(0.0, started + patience - time.monotonic()))
                continue
            except subprocess.TimeoutExpired:
                pass
            try:
                tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for member in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.kill()
            process.wait()
