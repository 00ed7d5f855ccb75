"""Run a DAG of stage nodes: reuse complete outputs, dispatch the rest, track every node.

Keys are computed for the whole DAG before anything runs. A node whose output is complete is a cache hit and
never dispatched; the others go to the launcher when their inputs exist (local, inline) or at once with
dependencies (Slurm). The first failure cancels what is still running and ends the pipeline with one line.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

from omegaconf import DictConfig
from rich.console import Console

from pipelines.core.cache import CacheCheck, is_complete, keys_for, output_dir, verified_hit
from pipelines.core.dag import Node, check_graph, resolve
from pipelines.core.jobs import StageFailed, StageOutcome, outcome_from_manifest
from pipelines.core.progress import show as show_progress
from stages.common.contract.artifacts import package_versions
from stages.common.contract.errors import RegraftError


class JobLauncher(Protocol):
    """What the runner asks of where jobs run (pipelines/launch/: inline, local, Slurm)."""

    chains: bool  # True: jobs are submitted before their inputs exist, with scheduler dependencies
    in_process: bool  # True: submit runs the stage itself

    def can_start(self, node: Node) -> bool:
        """Whether the node's job may be submitted now (locally: the GPUs it holds are free)."""

    def submit(self, node: Node, config: DictConfig, after: list[Any]) -> Any:
        """A job for the node, after the upstream jobs `after` (chained launchers only)."""

    def finished(self, job: Any) -> bool: ...

    def outcome(self, job: Any) -> StageOutcome:
        """The job's result, or StageFailed with its stage's own line."""

    def cancel(self, job: Any) -> None: ...

    def stop(self, jobs: list[Any], grace_s: float) -> None:
        """After `cancel`: wait for the jobs to end, up to `grace_s`."""

    def log_of(self, job: Any) -> str: ...


class StageTracker(Protocol):
    """What the runner tells tracking (pipelines/tracking/tracker.py::Tracker; a sweep's fan-out in pipelines/sweep.py)."""

    def start_stage(self, node: Node, key: str, config: DictConfig, hit: bool) -> str:
        """A run for the node; returns the handle finish_stage takes."""

    def finish_stage(self, handle: str, outcome: StageOutcome | None, error: str | None = None, job_id: str = "",
                     log: str = "", status: str = "FAILED", versions_note: str = "") -> None:
        """The node's outcome, or without one its error and status."""


# How long a cancelled local job may take to stop: a fine-tune finishes its optimizer step and saves a checkpoint.
CANCEL_GRACE_S = 120.0


@dataclass
class NodeResult:
    name: str
    stage: str
    phase: str
    key: str
    out: str
    hit: bool
    seconds: float  # the stage's own work (0 for a hit)
    wall_seconds: float  # from the decision to run it to its result tracked: the stage plus running it as a job
    metrics: dict[str, Any] = field(default_factory=dict)
    headline: str = ""
    job_id: str = ""
    versions_note: str = ""  # a hit made under other package versions than this run's: which ones


    @property
    def overhead_seconds(self) -> float:
        """What orchestration cost this stage: job start, imports, polling, tracking."""
        return max(0.0, self.wall_seconds - self.seconds)


@dataclass
class Running:
    node: Node
    job: Any
    run_id: str
    started: float


class Interrupts:
    """SIGINT and SIGTERM as KeyboardInterrupt (`handler`), held back while a job is started or collected (`held`),
    so the cancel that follows an interrupt finds every job regraft started and closes every run it opened."""

    holding = False
    pending: int | None = None

    @classmethod
    def handler(cls, number: int, frame) -> None:
        if cls.holding:
            cls.pending = number
            return
        raise KeyboardInterrupt(f"signal {number}")

    @classmethod
    @contextlib.contextmanager
    def held(cls) -> Iterator[None]:
        cls.holding = True
        try:
            yield
        finally:
            cls.holding = False
            if cls.pending is not None:
                number, cls.pending = cls.pending, None
                raise KeyboardInterrupt(f"signal {number}")


def versions_note(outcome: StageOutcome) -> str:
    """'torch 2.12.0 (now 2.13.0)' for every package of the stage's own interpreter whose version differs from this
    one's, and 'engine vllm 0.11.0 (now 0.12.0)' for every package of the engine it ran (vLLM's venv) whose version
    differs from that interpreter's now."""
    def differing(made_with: dict[str, str], now: dict[str, str], prefix: str = "") -> list[str]:
        return [f"{prefix}{name} {made_with[name]} (now {now.get(name, 'absent')})" for name in sorted(made_with)
                if made_with[name] != now.get(name)]

    notes = differing(outcome.versions, package_versions())
    if outcome.engine_versions:
        notes += differing(outcome.engine_versions, package_versions(outcome.engine_python), "engine ")
    return ", ".join(notes)


def submit_error(exc: BaseException) -> str:
    """A failed submit in one line: the launcher's own words (a RegraftError), else the exception's type and first
    line (an sbatch that refused, a pickling error)."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return text if isinstance(exc, RegraftError) else f"{type(exc).__name__}: {text}"


def pending(nodes: list[Node], keys: dict[str, str], cache_root: Path) -> list[Node]:
    """The nodes without a complete output now: what a run will dispatch unless a sweep member gets there first."""
    return [node for node in nodes if not is_complete(output_dir(cache_root, node.stage, keys[node.name]))]


def run_dag(nodes: list[Node], cache_root: Path, launcher: JobLauncher, tracker: StageTracker | None,
            console: Console, poll_s: float = 0.2, max_parallel: int | None = None,
            keys: dict[str, str] | None = None, done: dict[str, NodeResult] | None = None,
            failures: dict[str, str] | None = None, check: CacheCheck = CacheCheck()) -> dict[str, NodeResult]:
    """`keys`: the nodes' cache keys when the caller has them already (keys_for). `done`: results of nodes run
    before (a race's earlier rungs) that these may read; they are neither run nor tracked again. `failures`: keep
    going past a failed node (a sweep): its line is put there, every node downstream of it is cancelled or never
    dispatched (`not run: X failed`), the rest run on; the results hold the nodes that finished. `check`: what a
    cache hit is checked for (pipelines/core/cache.py); an output that fails it is removed and its node dispatched."""
    done = done or {}
    check_graph(nodes, set(done))
    keys = keys or keys_for(nodes)
    outputs = {node.name: output_dir(cache_root, node.stage, keys[node.name]) for node in nodes}
    outputs.update({name: Path(result.out) for name, result in done.items()})
    results: dict[str, NodeResult] = dict(done)
    running: dict[str, Running] = {}
    waiting = list(nodes)

    def record(node: Node, outcome: StageOutcome, started: float, run_id: str | None, job_id: str = "") -> None:
        note = versions_note(outcome) if outcome.hit else ""
        if tracker is not None and run_id is not None:
            tracker.finish_stage(run_id, outcome, job_id=job_id, versions_note=note)
        results[node.name] = NodeResult(node.name, node.stage, node.phase, keys[node.name], outcome.out, outcome.hit,
                                        outcome.seconds, time.perf_counter() - started, outcome.metrics,
                                        outcome.headline, job_id, note)
        state = "cached" if outcome.hit else f"done in {outcome.seconds:.1f} s"
        console.print(f"[green]{node.name:>18}[/green] {state}: {outcome.headline}", highlight=False)
        if note:
            console.print(f"[yellow]{'':>18}[/yellow] cached under other package versions: {note}", highlight=False)

    def dispatchable(node: Node) -> bool:
        if max_parallel and len(running) >= max_parallel:
            return False
        if launcher.chains:
            ready = all(up in results or up in running for up in node.upstream)
        else:
            ready = all(up in results for up in node.upstream)
        return ready and launcher.can_start(node)  # locally: the GPUs it holds are free

    def dispatch(node: Node) -> None:
        waiting.remove(node)
        started = time.perf_counter()
        config = resolve(node.config, outputs)
        config.out = str(outputs[node.name])
        hit = verified_hit(outputs[node.name], check, lambda line: console.print(
            f"[yellow]{node.name:>18}[/yellow] cache: {line}", highlight=False, soft_wrap=True))
        run_id = tracker.start_stage(node, keys[node.name], config, hit) if tracker else None
        if hit:
            record(node, outcome_from_manifest(outputs[node.name], True, 0.0), started, run_id)
            return
        console.print(f"[cyan]{node.name:>18}[/cyan] dispatched ({keys[node.name]})", highlight=False)
        after = [running[up].job for up in node.upstream if up in running]
        try:
            job = launcher.submit(node, config, after)
        except BaseException as exc:  # its run is open already: closed here, or the next command calls it KILLED
            if tracker is not None and run_id is not None:
                tracker.finish_stage(run_id, None, f"not submitted: {submit_error(exc)}",
                                     status="KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        running[node.name] = Running(node, job, run_id, started)

    def collect(name: str, item: Running) -> None:
        del running[name]
        try:
            outcome = launcher.outcome(item.job)
        except RegraftError as exc:
            failed = exc if isinstance(exc, StageFailed) else StageFailed(str(exc), launcher.log_of(item.job))
            failed.node = name
            if tracker is not None and item.run_id:
                tracker.finish_stage(item.run_id, None, failed.line, item.job.job_id, failed.log or "")
            if failures is None:
                raise failed from None
            failures[name] = failed.line
            console.print(f"[red]{name:>18}[/red] failed: {failed.line} (log: {failed.log})", highlight=False)
            drop_downstream(name)
            return
        record(item.node, outcome, item.started, item.run_id, item.job.job_id)

    def drop_downstream(failed: str) -> None:
        """Everything that reads a failed node, directly or not: cancelled if submitted (a Slurm job waiting on
        afterok would wait forever), else never dispatched."""
        lost = {failed}
        for node in nodes:  # topological order: one pass reaches every descendant
            if node.name in lost or not lost & set(node.upstream):
                continue
            lost.add(node.name)
            failures[node.name] = f"not run: {failed} failed"
            if node.name in running:
                item = running.pop(node.name)
                launcher.cancel(item.job)
                if tracker is not None and item.run_id:
                    tracker.finish_stage(item.run_id, None, failures[node.name], item.job.job_id)
        waiting[:] = [node for node in waiting if node.name not in lost]

    # an inline stage runs inside submit: Ctrl-C must reach it there
    bookkeeping = contextlib.nullcontext if launcher.in_process else Interrupts.held
    try:
        while waiting or running:
            for node in list(waiting):
                if dispatchable(node):
                    with bookkeeping():
                        dispatch(node)
            for name, item in list(running.items()):
                if name in running and launcher.finished(item.job):  # a failure may have cancelled it just now
                    with bookkeeping():
                        collect(name, item)
            show_progress(console, running, launcher)  # each running stage's latest log line (pipelines/core/progress.py)
            if running:
                time.sleep(poll_s)
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        for item in running.values():
            launcher.cancel(item.job)
        launcher.stop([item.job for item in running.values()], CANCEL_GRACE_S)
        for item in running.values():
            if tracker is not None and item.run_id:
                reason = "cancelled: regraft was interrupted" if interrupted else "cancelled: another stage failed"
                tracker.finish_stage(item.run_id, None, reason, item.job.job_id,
                                     status="KILLED" if interrupted else "FAILED")
        raise
    return {node.name: results[node.name] for node in nodes if node.name in results}

