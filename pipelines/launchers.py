"""Where stage jobs run: `launcher=local` (submitit's local executor, the default), `launcher=slurm` (submitit on
Slurm, stages chained with afterok dependencies) or `launcher=inline` (this process, for debugging).

Every launcher runs `pipelines.jobs.run_stage` and hands back submitit-like jobs; the orchestrator asks each one
`can_start(node)`, then `finished(job)` and `outcome(job)`. Local jobs start only once their inputs exist (the local
executor has no queue) and the GPUs they hold are free; Slurm jobs are all submitted at once and wait in Slurm's
queue on their upstream jobs.

What a node's stage holds (its schema's `holds`: GPUs, ranks, a server; stages/common/contract/hardware.py) on a
node of `launcher.node_gpus` GPUs (pipelines/node_gpus.py) is asked of Slurm in each job, and decides which GPU ids
a local job gets (CUDA_VISIBLE_DEVICES) and when it may start.
"""
from __future__ import annotations

import contextlib
import json
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from pipelines.dag import Node, base_name
from pipelines.jobs import (OnGpus, resumable, StageFailed, StageOutcome, error_line, reported_error, run_stage,
                           schema_module, stage_names)
from pipelines.node_gpus import GpuPool, NodeGpus, slurm_node, this_machine, where_counted
from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Holds
from stages.common.contract.stage import SCHEMAS, check_config


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


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def check_per_stage(cfg: DictConfig) -> None:
    """`launcher.per_stage` is keyed by stage (a module under stages/), never by node name: a node's own settings
    go under `launcher.per_node`, so one key can mean one thing only."""
    stages = stage_names()
    for key in cfg.get("per_stage") or {}:
        if key not in stages:
            raise RegraftError(f"launcher.per_stage.{key}", f"{key} is not a stage (the stages: {', '.join(stages)}); "
                               "launcher.per_stage applies to every node of a stage",
                               f"for the node named {key} alone use launcher.per_node.{key}")


HELD = "held"  # the layer of a job's resources that its stage's holds gives (no config path: the stage's own settings)


def held_resources(holds: Holds) -> dict[str, int]:
    """What a stage holds as a job's resources: only what differs from a job that holds nothing (1 node, 1 task, no
    GPU), so a stage that holds no GPU keeps `launcher.resources`' own."""
    wanted = {"gpus_per_node": holds.gpus} if holds.gpus else {}
    if (holds.nodes, holds.tasks_per_node) != (1, 1):
        wanted.update(nodes=holds.nodes, tasks_per_node=holds.tasks_per_node)
    return wanted


class Launcher:
    chains = False  # True: submits jobs whose inputs do not exist yet, with scheduler dependencies
    in_process = False  # True: submit runs the stage itself

    def __init__(self, cfg: DictConfig, folder: Path):
        self.cfg, self.folder = cfg, folder
        self.gpus: NodeGpus | None = None  # a node's GPUs, read once when first asked
        check_per_stage(cfg)

    def node_gpus(self) -> NodeGpus:
        """The GPUs of a node this launcher runs stages on: launcher.node_gpus, or counted on this machine."""
        if self.gpus is None:
            self.gpus = this_machine(self.cfg.get("node_gpus"))
        return self.gpus

    def holds(self, node: Node) -> Holds:
        """What the node's stage holds on a node of `node_gpus` (its schema's `holds`; nothing without one)."""
        schema = schema_module(node.stage)
        if not hasattr(schema, "holds"):
            return Holds()
        config = node.config
        if node.stage in SCHEMAS:  # its defaults under a node config that leaves some out
            config = OmegaConf.structured(SCHEMAS[node.stage])
            OmegaConf.set_struct(config, False)
            config = OmegaConf.merge(config, node.config)
        return schema.holds(config, self.node_gpus().count)

    def layers(self, node: Node) -> list[tuple[str, Any]]:
        """The settings a node's job gets, least specific first, each as (its config path, its value):
        `launcher.resources` (every job), what the node's stage holds (GPUs, ranks: `held_resources`),
        `launcher.per_stage.<stage>` (every node of the node's stage: a race's rungs and `source_drafter` are
        finetune nodes; `evaluate`, `baseline_evaluate` and a race finalist's evaluation are probe nodes),
        `launcher.per_node.<name>` by what the node is (`features` for `features_3#2`), then by its name in one
        member (`features_3`), then by its exact name. Only those present."""
        per_stage, per_node = self.cfg.get("per_stage") or {}, self.cfg.get("per_node") or {}
        found = [("launcher.resources", self.cfg.get("resources") or {})]
        found.append((HELD, held_resources(self.holds(node))))
        found.append((f"launcher.per_stage.{node.stage}", per_stage.get(node.stage)))
        for name in dict.fromkeys([base_name(node.name), node.name.split("#")[0], node.name]):
            found.append((f"launcher.per_node.{name}", per_node.get(name)))
        return [(path, value) for path, value in found if value is not None]

    def resources(self, node: Node) -> dict[str, Any]:
        """The node's `layers` merged, each over the one before; each resolved first, while its interpolations
        (slurm's `${finetune.nproc}`) can still reach the root config."""
        return OmegaConf.to_container(OmegaConf.merge(*(
            OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else dict(value)
            for _, value in self.layers(node))))

    def setting_of(self, node: Node, key: str) -> str:
        """The config path that gives the node's job `key` (the most specific layer that has it), for a fix that
        names it; a node-wide one when only `launcher.resources` has it (changing that changes every job)."""
        paths = [path for path, value in self.layers(node) if key in value]
        if not paths or paths[-1] in ("launcher.resources", HELD):
            return f"launcher.per_node.{node.name}.{key}"
        return f"{paths[-1]}.{key}"

    def check_machine(self, planning: bool) -> None:
        """Before any work, once: whether this machine can run what the launcher was told of it. Here: the GPUs
        launcher.node_gpus says a node has are there (a local job gets them as CUDA_VISIBLE_DEVICES)."""
        gpus = self.node_gpus()
        if len(gpus.ids) < gpus.count:
            raise RegraftError(f"launcher.node_gpus={gpus.count}", f"this machine shows {len(gpus.ids)} GPU(s) "
                               f"({where_counted()})", "set launcher.node_gpus=null to count them, or run where "
                               f"{gpus.count} are (launcher=slurm asks a cluster for them)")

    def gpus_asked(self, node: Node) -> int:
        """The GPUs the node's job gets: what its stage holds, unless per_stage or per_node ask for more (a server
        regraft does not start but that runs on the node's GPUs, say)."""
        return int(self.resources(node).get("gpus_per_node") or 0)

    def check_gpus(self, node: Node) -> None:
        """A node's job holds no more GPUs than a node has, where that count is known (else it would never start),
        and no fewer than its stage holds (its engine or ranks would not start)."""
        self.check_held_gpus(node)
        gpus, held, asked = self.node_gpus(), self.holds(node), self.gpus_asked(node)
        setting = self.setting_of(node, "gpus_per_node")
        if gpus.known and asked > gpus.count:
            raise RegraftError(f"{setting}={asked}", f"asks for more GPUs than a node has ({gpus.count}: {gpus.said})",
                               f"set it to at most {gpus.count}, or drop it: {node.name} holds {held.gpus}")
        if asked < held.gpus:
            raise RegraftError(f"{setting}={asked}", f"{node.name} holds {held.describe()}",
                               f"set it to {held.gpus}, or drop it")

    def check_held_gpus(self, node: Node) -> None:
        gpus, holds = self.node_gpus(), self.holds(node)
        if not gpus.known or holds.gpus <= gpus.count:
            return
        setting = self.cfg.get("node_gpus")
        lower = f"lower the stage's tensor-parallel size or ranks to {gpus.count}" if gpus.count else \
            "let the stage compute on the CPU (its device)"
        raise RegraftError(f"launcher.node_gpus={'null' if setting is None else setting}",
                           f"{node.name} holds {holds.describe()}, but a node has {gpus.count} GPU(s) ({gpus.said})",
                           f"{lower}, or run it where a node has {holds.gpus} (launcher.node_gpus={holds.gpus})")

    def check(self, node: Node, config: dict[str, Any]) -> None:
        """Before any work: whether this launcher can run the node as its config asks (RegraftError if not). The
        stage's schema module (stages/schemas/) holds its hooks: on this machine, `check_ranks` (the ranks its spawn
        mode starts) and `check_before_work` (an engine that must be installed, say). The node's config is checked
        against its stage's schema too: the DAG sets some of it (an online fine-tune's engine, say), so the
        pipeline config's check cannot see it."""
        hooks = schema_module(node.stage)
        if node.stage in SCHEMAS:
            check_config(OmegaConf.create(config), SCHEMAS[node.stage], node.stage)
        for hook in ("check_ranks", "check_before_work"):
            if hasattr(hooks, hook):
                getattr(hooks, hook)(config, node.stage)
        self.check_gpus(node)

    def prepare(self, nodes: list[Node]) -> None:
        """Called once before dispatching, with the nodes that will (probably) run."""

    def can_start(self, node: Node) -> bool:
        """Whether the node's job may be submitted now, its inputs being ready (or chained)."""
        return True

    def submit(self, node: Node, config: DictConfig, after: list[Any]) -> Any:
        raise NotImplementedError

    def finished(self, job: Any) -> bool:
        return job.done()

    def outcome(self, job: Any) -> StageOutcome:
        raise NotImplementedError

    def cancel(self, job: Any) -> None:
        pass

    def stop(self, jobs: list[Any], grace_s: float) -> None:
        """After `cancel`: wait for the jobs to end (a local one would otherwise die with regraft)."""

    def log_of(self, job: Any) -> str:
        paths = getattr(job, "paths", None)
        return str(paths.stderr) if paths is not None else ""


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


class SubmititLauncher(Launcher):
    """Shared by the local and Slurm launchers: an executor, and failures read from the job's own log."""

    def executor(self, node: Node, after: list[Any]):
        raise NotImplementedError

    def outcome(self, job) -> StageOutcome:
        """The job's result, or its stage's own error line (a job killed before it could leave one: how it ended)."""
        import submitit

        try:
            return job.result()
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as exc:
            own = reported_error(job.paths.stderr)
            raise StageFailed(own or f"the job ended without a result: {last_line(str(exc))}",
                              job.paths.stderr) from None


class LocalLauncher(SubmititLauncher):
    """submitit's local executor; with `warm: true` its jobs fork from one interpreter that imported torch and
    the stages once (pipelines/warm.py) instead of each importing them again (~4 s a job on 2 cores).

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
            from pipelines.warm import shared_interpreter

            self.warm = shared_interpreter(sorted({f"stages.{node.stage}" for node in nodes}),
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


class SlurmLauncher(SubmititLauncher):
    """One Slurm job per stage through submitit, each submitted with `afterok` on its upstream jobs.

    A stage with `tasks_per_node` (x `nodes`) > 1 runs as that many ranks (`pipelines.jobs.run_ranks`), rank 0's node
    the rendezvous (submitit's MASTER_ADDR: the first host of the allocation); the rank layout changes the global
    batch, so it must equal the stage's `nodes` x `nproc`, which are part of its cache key.
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

    def node_gpus(self) -> NodeGpus:
        """launcher.node_gpus, else what sinfo says of the partition's nodes, else 0 (not known: CPU nodes)."""
        if self.gpus is None:
            partition = (self.cfg.get("resources") or {}).get("slurm_partition")
            self.gpus = slurm_node(self.cfg.get("node_gpus"), partition)
        return self.gpus

    def check_machine(self, planning: bool) -> None:
        """A run submits from this machine, so Slurm's commands must be here; a plan only writes the scripts."""
        from pipelines.slurm_jobs import missing_commands

        missing = missing_commands()
        if missing and not planning:
            raise RegraftError("launcher=slurm", f"Slurm's commands are not on this machine ({', '.join(missing)} "
                               "not on PATH)", "run regraft on a login node of the cluster, or plan here only: "
                               "pipeline.plan=true writes each job's batch script")

    def executor(self, node: Node, after: list[Any], resources: dict[str, Any] | None = None):
        from pipelines.slurm_jobs import ScriptExecutor

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
        from pipelines.jobs import Resumable, resumable, run_ranks
        from pipelines.slurm_jobs import dependency_of

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
