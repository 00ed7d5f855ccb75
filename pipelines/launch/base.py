"""What every launcher is: `Launcher` (a job's resources in layers, the checks before any work, the calls the runner
makes) and `SubmititLauncher` (the local and Slurm launchers' shared part). The launchers themselves: inline.py,
local.py, slurm.py; `launcher=NAME` picks one (make.py).

Every launcher runs `pipelines.core.jobs.run_stage` and hands back submitit-like jobs; the runner asks each one
`can_start(node)`, then `finished(job)` and `outcome(job)`. Local jobs start only once their inputs exist (the local
executor has no queue) and the GPUs they hold are free; Slurm jobs are all submitted at once and wait in Slurm's
queue on their upstream jobs.

What a node's stage holds (its schema's `holds`: GPUs, ranks, a server; stages/common/contract/hardware.py) on a
node of `launcher.node_gpus` GPUs (pipelines/launch/node_gpus.py) is asked of Slurm in each job, and decides which GPU
ids a local job gets (CUDA_VISIBLE_DEVICES) and when it may start.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipelines.core.dag import Node, base_name
from pipelines.core.jobs import StageFailed, StageOutcome, reported_error
from pipelines.core.registry import schema_module, stage_names
from pipelines.launch.node_gpus import NodeGpus, this_machine, where_counted
from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Holds
from stages.common.contract.stage import SCHEMAS, check_config


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
