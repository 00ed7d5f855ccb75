"""A sweep is one DAG: `regraft -m ...` expands every member, dedupes their stages by cache key and dispatches all
that is ready at once (on Slurm every job is submitted up front with afterok; locally up to launcher.max_parallel).

Hydra hands the whole sweep to regraft's launcher (hydra_plugins/regraft_launcher), which
1. plans each member through Hydra's own `run_job` (its run folder, `.hydra/` and config, as a basic sweep has),
   checking it before any work;
2. runs the union of the members' nodes as one DAG (`run_sweep`): a node two members share is one job, and each
   member's MLflow parent run gets its own child run for it (the first member to reach it computed it; the others
   record a cache hit, as they would run member by member);
3. finishes every member: its run folder's `summary.json` and plots, its parent run, then Hydra's sweep table.

A member whose stage fails does not stop the others: the nodes downstream of the failure are cancelled, the rest
finish, and the failed member's summary (and the sweep table) says which stage failed and why, in one line.
A member with `pipeline.race=true` grows its DAG rung by rung, so it runs after the others, on its own.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from pipelines.core.cache import CacheCheck, keys_for
from pipelines.core.dag import Node, build_nodes, substitute
from pipelines.core.runner import NodeResult, run_dag
from pipelines.launch.make import make_launcher
from pipelines.modes.preflight import check_before_any_work
from pipelines.report.summary import finish_run
from pipelines.tracking.run_names import Invocation, hydra_invocation
from pipelines.tracking.tracker import Tracker
from pipelines.core.data_sets import settle_data
from stages.common.contract.errors import RegraftError


@dataclass
class Member:
    """One sweep member, planned: its resolved config, run folder and nodes (named as in a single run)."""

    num: int
    cfg: DictConfig
    run_dir: Path
    overrides: list[str]
    invocation: Invocation
    nodes: list[Node]
    keys: dict[str, str]
    tracker: Tracker | None = None
    failed: str | None = None  # `<node>: <its line>` when a stage of this member failed
    summary: dict = field(default_factory=dict)

    @property
    def races(self) -> bool:
        return bool(self.cfg.pipeline.race)


def plan_member(cfg: DictConfig) -> Member:
    """Called inside Hydra's run_job, while the member's HydraConfig is set: everything resolved now."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task)
    num = int(HydraConfig.get().job.num)
    cfg = cfg.copy()
    if cfg.pipeline.plan:
        raise RegraftError("pipeline.plan=true", "plans one run, not a sweep",
                           "drop -m and plan one setting of the sweep (its shared stages are planned with it)")
    settle_data(cfg)  # named sets as chat JSONL paths before the config is resolved against the stages' schemas
    OmegaConf.resolve(cfg)  # paths.run is this member's folder: ${hydra:runtime.output_dir}
    nodes = build_nodes(cfg)
    check_before_any_work(cfg, nodes, make_launcher(cfg.launcher, Path(cfg.paths.run) / "jobs"))
    return Member(num, cfg, Path(cfg.paths.run), overrides, hydra_invocation(overrides), nodes, keys_for(nodes))


def union(members: list[Member]) -> tuple[list[Node], dict[tuple[int, str], str]]:
    """Every member's nodes as one DAG, one node per cache key, and which union node each member's node is.

    A node keeps its own name (`finetune`) unless another member's node of that name differs: `finetune#2`."""
    nodes: list[Node] = []
    by_key: dict[str, str] = {}
    names: dict[tuple[int, str], str] = {}
    for member in members:
        for node in member.nodes:
            key = member.keys[node.name]
            if key not in by_key:
                name = node.name if all(n.name != node.name for n in nodes) else f"{node.name}#{member.num}"
                config = substitute(node.config, lambda up, sub, m=member.num: f"@{names[(m, up)]}"
                                    + (f"/{sub}" if sub else ""))
                nodes.append(Node(name, node.stage, config, node.phase))
                by_key[key] = name
            names[(member.num, node.name)] = by_key[key]
    return nodes, names


class MemberTrackers:
    """The Tracker interface run_dag calls, fanned out: a union node's child run in every member that has it.

    The first member computes a shared stage; the others' child runs record it as a cache hit pointing at the run
    that holds its artifacts, exactly as when the members run one after another."""

    def __init__(self, members: list[Member], names: dict[tuple[int, str], str]):
        self.subscribers: dict[str, list[tuple[Member, str]]] = {}
        for member in members:
            for node in member.nodes:
                self.subscribers.setdefault(names[(member.num, node.name)], []).append((member, node.name))
        self.open: dict[str, list[tuple[Tracker, str]]] = {}
        self.tokens = itertools.count()  # never reused: a run's token must not name a later one

    def start_stage(self, node: Node, key: str, config: DictConfig, hit: bool) -> str:
        runs = []
        for member, own_name in self.subscribers[node.name]:
            if member.tracker is not None:
                own = next(n for n in member.nodes if n.name == own_name)
                runs.append((member.tracker, member.tracker.start_stage(own, key, config, hit)))
        token = f"fan-{next(self.tokens)}"
        self.open[token] = runs
        return token

    def finish_stage(self, run_id: str, outcome, *args, **kwargs) -> None:
        for index, (tracker, own_id) in enumerate(self.open.pop(run_id, [])):
            shared = outcome if outcome is None or index == 0 else dataclasses.replace(outcome, hit=True)
            tracker.finish_stage(own_id, shared, *args, **kwargs)


def member_results(member: Member, names: dict[tuple[int, str], str], results: dict[str, NodeResult],
                   first_user: dict[str, int]) -> dict[str, NodeResult]:
    """The member's results under its own node names; a stage an earlier member computed is a hit here."""
    own: dict[str, NodeResult] = {}
    for node in member.nodes:
        result = results.get(names[(member.num, node.name)])
        if result is None:
            continue
        if not result.hit and first_user[result.name] != member.num:
            result = dataclasses.replace(result, hit=True, seconds=0.0, wall_seconds=0.0, job_id="")
        own[node.name] = dataclasses.replace(result, name=node.name)
    return own


def failure_line(member: Member, names: dict[tuple[int, str], str], failures: dict[str, str]) -> str | None:
    """The member's first failed stage that failed itself (not one cancelled because an upstream failed)."""
    lost = [(node.name, failures[names[(member.num, node.name)]]) for node in member.nodes
            if names[(member.num, node.name)] in failures]
    own = [item for item in lost if not item[1].startswith("not run:")]
    return f"{own[0][0]}: {own[0][1]}" if own else (f"{lost[0][0]}: {lost[0][1]}" if lost else None)


def check_one_launcher(members: list[Member]) -> None:
    """One DAG runs on one launcher and one cache: members may not differ in them."""
    first = members[0].cfg
    for member in members[1:]:
        for key in ("launcher", "paths.cache"):
            if OmegaConf.select(member.cfg, key) != OmegaConf.select(first, key):
                raise RegraftError(f"{key}", f"differs between sweep members 0 and {member.num}; a sweep is one DAG "
                                   "on one launcher and one cache", f"sweep {key} in separate invocations, or "
                                   "run the members one after another (hydra/launcher=basic)")


def run_sweep(members: list[Member], sweep_dir: Path, console: Console) -> None:
    """Every member's stages as one DAG (race members after it, one by one); each member finished on its own."""
    from pipelines.pipeline import closing_on_failure, get_ready, run_pipeline

    start = time.perf_counter()
    check_one_launcher(members)
    plain = [member for member in members if not member.races]
    base = (plain or members)[0].cfg
    launcher = make_launcher(base.launcher, sweep_dir / "jobs")
    nodes, names = union(plain)
    keys = keys_for(nodes)
    get_ready(launcher, base, nodes, keys)
    for member in plain:
        member.tracker = Tracker.for_pipeline(member.cfg.tracking, member.invocation, member.overrides, member.run_dir)
    failures: dict[str, str] = {}
    with closing_on_failure([member.tracker for member in plain]):
        results = run_dag(nodes, Path(base.paths.cache), launcher, MemberTrackers(plain, names), console,
                          base.launcher.poll_s, base.launcher.max_parallel, keys, failures=failures,
                          check=CacheCheck.of(base.cache))
    first_user: dict[str, int] = {}
    for member in plain:
        for node in member.nodes:
            first_user.setdefault(names[(member.num, node.name)], member.num)
    for member in plain:
        member.failed = failure_line(member, names, failures)
        member.summary, _ = finish_run(member.run_dir, member_results(member, names, results, first_user),
                                       member.cfg, member.overrides, time.perf_counter() - start, member.tracker,
                                       failed=member.failed)
    for member in members:
        if member.races:
            member.summary = run_pipeline(member.cfg, member.run_dir, member.overrides, console).summary
