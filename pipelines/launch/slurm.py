"""`launcher=slurm`: one Slurm job per stage through submitit, chained with `afterok` dependencies; job states and
batch scripts are in slurm_jobs.py."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipelines.core.dag import Node
from pipelines.core.jobs import StageOutcome, run_stage
from pipelines.launch.base import SubmititLauncher
from pipelines.launch.node_gpus import NodeGpus, slurm_node
from stages.common.contract.errors import RegraftError


class SlurmLauncher(SubmititLauncher):
    """One Slurm job per stage through submitit, each submitted with `afterok` on its upstream jobs.

    A stage with `tasks_per_node` (x `nodes`) > 1 runs as that many ranks (`pipelines.core.jobs.run_ranks`), rank 0's
    node the rendezvous (submitit's MASTER_ADDR: the first host of the allocation); the rank layout changes the global
    batch, so it must equal the stage's `nodes` x `nproc`, which are part of its cache key.
    Resumable stages (finetune) are submitted `--requeue` and checkpointable (`pipelines.core.jobs.Resumable`).
    Every submission is recorded in `<run>/jobs/submitted.jsonl` (node, job id, upstream ids, Slurm's
    `Dependency=` read back right after sbatch).
    """

    chains = True

    def __init__(self, cfg: DictConfig, folder: Path):
        super().__init__(cfg, folder)
        self.watching: set[str] = set()  # job ids not yet seen finished
        self.known: dict[str, Any] = {}  # one squeue answer for all of them, refreshed once per poll
        self.polled = 0.0

    def node_gpus(self) -> NodeGpus:
        """launcher.node_gpus, else what sinfo says of the partition's nodes, else 0 (not known: CPU nodes)."""
        if self.gpus is None:
            partition = (self.cfg.get("resources") or {}).get("slurm_partition")
            self.gpus = slurm_node(self.cfg.get("node_gpus"), partition)
        return self.gpus

    def check_machine(self, planning: bool) -> None:
        """A run submits from this machine, so Slurm's commands must be here; a plan only writes the scripts."""
        from pipelines.launch.slurm_jobs import missing_commands

        missing = missing_commands()
        if missing and not planning:
            raise RegraftError("launcher=slurm", f"Slurm's commands are not on this machine ({', '.join(missing)} "
                               "not on PATH)", "run regraft on a login node of the cluster, or plan here only: "
                               "pipeline.plan=true writes each job's batch script")

    def executor(self, node: Node, after: list[Any], resources: dict[str, Any] | None = None):
        from pipelines.launch.slurm_jobs import ScriptExecutor

        resources = dict(resources or self.resources(node))
        executor = ScriptExecutor(self.folder / "%j", python=self.cfg.get("python") or None,
                                  max_num_timeout=self.cfg.get("max_num_timeout", 3))
        extra = dict(resources.pop("additional_parameters", None) or {})
        if after:
            extra["dependency"] = "afterok:" + ":".join(job.job_id for job in after)
        executor.set_resources({"name": f"regraft-{node.name}", "slurm_additional_parameters": extra,
                                **{key: value for key, value in resources.items() if value is not None}})
        return executor

    def tasks(self, node: Node) -> int:
        resources = self.resources(node)
        return int(resources.get("tasks_per_node") or 1) * int(resources.get("nodes") or 1)

    def check(self, node: Node, config: dict[str, Any]) -> None:
        """The GPUs a job asks for: at least what its stage holds, at most what a node has. A multi-task job is one
        rank per task: only for a stage with ranks, and exactly its `nodes` x `nproc`, laid out as the stage says (the
        layout is in its cache key)."""
        self.check_gpus(node)
        resources = self.resources(node)
        per_node, nodes = int(resources.get("tasks_per_node") or 1), int(resources.get("nodes") or 1)
        if per_node * nodes > 1 and "nproc" not in config:
            fix = [f"{self.setting_of(node, key)}=1" for key, count in (("tasks_per_node", per_node), ("nodes", nodes))
                   if count > 1]
            raise RegraftError(None, f"{node.name} runs as one task, the launcher gives it {per_node * nodes}",
                               f"set {' and '.join(fix)}")
        if "nproc" not in config:
            return
        want = (int(config.get("nodes", 1)), int(config["nproc"]))
        if (nodes, per_node) != want:
            raise RegraftError(None, f"{node.name} would run as {nodes} node(s) x {per_node} Slurm tasks (ranks) but "
                               f"{node.stage}.nodes={want[0]} x {node.stage}.nproc={want[1]}; the rank layout sets "
                               "the global batch and belongs in the cache key",
                               f"set {node.stage}.nodes={nodes} {node.stage}.nproc={per_node}")

    def submit(self, node: Node, config: DictConfig, after: list[Any]):
        from pipelines.core.jobs import Resumable, resumable, run_ranks
        from pipelines.launch.slurm_jobs import dependency_of

        resources, tasks, plain = self.resources(node), self.tasks(node), OmegaConf.to_container(config)
        self.check(node, plain)
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
        from pipelines.launch.slurm_jobs import ACTIVE, _squeue, job_info

        if time.monotonic() - self.polled > self.cfg.poll_s / 2:
            self.known = _squeue(sorted(self.watching)) if self.watching else {}
            self.polled = time.monotonic()
        done = job_info(job, self.known).state not in ACTIVE
        if done:
            self.watching.discard(job.job_id)
        return done

    def outcome(self, job) -> StageOutcome:
        from pipelines.launch.slurm_jobs import wait_for

        result = wait_for([job])[0]
        return result[0] if isinstance(result, list) else result  # a multi-task job: rank 0's

    def cancel(self, job) -> None:
        import subprocess

        subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)
