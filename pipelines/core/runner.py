"""Run a DAG of stage nodes (`Scheduler`; `run_dag` runs one): reuse complete outputs, dispatch the rest, track
every node.

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
    """What the runner tells tracking (pipelines/tracking/tracker.py::Tracker; a sweep's fan-out in
    pipelines/sweep.py)."""

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
    """Run the nodes (Scheduler), and their results by name in the nodes' order."""
    return Scheduler(nodes, cache_root, launcher, tracker, console, poll_s, max_parallel, keys, done, failures,
                     check).run()


class Scheduler:
    """One DAG run: which nodes wait, which run and which are done; a node is dispatched when its inputs are done
    (or running, on a launcher that chains jobs) and the launcher can start it, and collected when its job ends.

    `keys`: the nodes' cache keys when the caller has them already (keys_for). `done`: results of nodes run before (a
    race's earlier rungs) that these may read; they are neither run nor tracked again. `failures`: keep going past a
    failed node (a sweep): its line is put there, every node downstream of it is cancelled or never dispatched
    (`not run: X failed`), the rest run on; the results hold the nodes that finished. `check`: what a cache hit is
    checked for (pipelines/core/cache.py); an output that fails it is removed and its node dispatched."""

    def __init__(self, nodes: list[Node], cache_root: Path, launcher: JobLauncher, tracker: StageTracker | None,
                 console: Console, poll_s: float = 0.2, max_parallel: int | None = None,
                 keys: dict[str, str] | None = None, done: dict[str, NodeResult] | None = None,
                 failures: dict[str, str] | None = None, check: CacheCheck = CacheCheck()):
        done = done or {}
        check_graph(nodes, set(done))
        self.nodes, self.launcher, self.tracker, self.console = nodes, launcher, tracker, console
        self.poll_s, self.max_parallel, self.failures, self.check = poll_s, max_parallel, failures, check
        self.keys = keys or keys_for(nodes)
        self.outputs = {node.name: output_dir(cache_root, node.stage, self.keys[node.name]) for node in nodes}
        self.outputs.update({name: Path(result.out) for name, result in done.items()})
        self.results: dict[str, NodeResult] = dict(done)
        self.running: dict[str, Running] = {}
        self.waiting = list(nodes)

    def run(self) -> dict[str, NodeResult]:
        """Dispatch what is ready and collect what finished until nothing waits or runs; on any exception (a failure,
        Ctrl-C) every running job is cancelled and its run closed, and the exception goes on up."""
        # an inline stage runs inside submit: Ctrl-C must reach it there
        bookkeeping = contextlib.nullcontext if self.launcher.in_process else Interrupts.held
        try:
            while self.waiting or self.running:
                for node in list(self.waiting):
                    if self.ready(node):
                        with bookkeeping():
                            self.dispatch(node)
                for name, item in list(self.running.items()):
                    if name in self.running and self.launcher.finished(item.job):  # a failure may have cancelled it
                        with bookkeeping():
                            self.collect(name, item)
                show_progress(self.console, self.running, self.launcher)  # each running stage's latest log line
                if self.running:
                    time.sleep(self.poll_s)
        except BaseException as exc:
            self.cancel_running(interrupted=isinstance(exc, KeyboardInterrupt))
            raise
        return {node.name: self.results[node.name] for node in self.nodes if node.name in self.results}

    def ready(self, node: Node) -> bool:
        """Whether the node may be dispatched now: a free slot (max_parallel), its inputs done (or running, on a
        launcher that chains jobs), and the launcher able to start it (locally: the GPUs it holds are free)."""
        if self.max_parallel and len(self.running) >= self.max_parallel:
            return False
        if self.launcher.chains:
            inputs = all(up in self.results or up in self.running for up in node.upstream)
        else:
            inputs = all(up in self.results for up in node.upstream)
        return inputs and self.launcher.can_start(node)

    def dispatch(self, node: Node) -> None:
        """A cache hit recorded at once; anything else submitted, after the upstream jobs still running."""
        self.waiting.remove(node)
        started = time.perf_counter()
        out = self.outputs[node.name]
        config = resolve(node.config, self.outputs)
        config.out = str(out)
        hit = verified_hit(out, self.check, lambda line: self.console.print(
            f"[yellow]{node.name:>18}[/yellow] cache: {line}", highlight=False, soft_wrap=True))
        run_id = self.tracker.start_stage(node, self.keys[node.name], config, hit) if self.tracker else None
        if hit:
            self.record(node, outcome_from_manifest(out, True, 0.0), started, run_id)
            return
        self.console.print(f"[cyan]{node.name:>18}[/cyan] dispatched ({self.keys[node.name]})", highlight=False)
        after = [self.running[up].job for up in node.upstream if up in self.running]
        try:
            job = self.launcher.submit(node, config, after)
        except BaseException as exc:  # its run is open already: closed here, or the next command calls it KILLED
            self.finish_run(run_id, f"not submitted: {submit_error(exc)}",
                            status="KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        self.running[node.name] = Running(node, job, run_id, started)

    def collect(self, name: str, item: Running) -> None:
        """A finished job's outcome recorded, or its failure: the run ends with it, or (a sweep) only what reads it
        does."""
        del self.running[name]
        try:
            outcome = self.launcher.outcome(item.job)
        except RegraftError as exc:
            failed = exc if isinstance(exc, StageFailed) else StageFailed(str(exc), self.launcher.log_of(item.job))
            failed.node = name
            self.finish_run(item.run_id, failed.line, item.job.job_id, failed.log or "")
            if self.failures is None:
                raise failed from None
            self.failures[name] = failed.line
            self.console.print(f"[red]{name:>18}[/red] failed: {failed.line} (log: {failed.log})", highlight=False)
            self.drop_downstream(name)
            return
        self.record(item.node, outcome, item.started, item.run_id, item.job.job_id)

    def record(self, node: Node, outcome: StageOutcome, started: float, run_id: str | None, job_id: str = "") -> None:
        """A node's outcome: into its run, its result and one line on the terminal."""
        note = versions_note(outcome) if outcome.hit else ""
        if self.tracker is not None and run_id is not None:
            self.tracker.finish_stage(run_id, outcome, job_id=job_id, versions_note=note)
        self.results[node.name] = NodeResult(node.name, node.stage, node.phase, self.keys[node.name], outcome.out,
                                             outcome.hit, outcome.seconds, time.perf_counter() - started,
                                             outcome.metrics, outcome.headline, job_id, note)
        state = "cached" if outcome.hit else f"done in {outcome.seconds:.1f} s"
        self.console.print(f"[green]{node.name:>18}[/green] {state}: {outcome.headline}", highlight=False)
        if note:
            self.console.print(f"[yellow]{'':>18}[/yellow] cached under other package versions: {note}",
                               highlight=False)

    def drop_downstream(self, failed: str) -> None:
        """Everything that reads a failed node, directly or not: cancelled if submitted (a Slurm job waiting on
        afterok would wait forever), else never dispatched."""
        lost = {failed}
        for node in self.nodes:  # topological order: one pass reaches every descendant
            if node.name in lost or not lost & set(node.upstream):
                continue
            lost.add(node.name)
            self.failures[node.name] = f"not run: {failed} failed"
            if node.name in self.running:
                item = self.running.pop(node.name)
                self.launcher.cancel(item.job)
                self.finish_run(item.run_id, self.failures[node.name], item.job.job_id)
        self.waiting[:] = [node for node in self.waiting if node.name not in lost]

    def cancel_running(self, interrupted: bool) -> None:
        """Every running job cancelled, waited for (up to CANCEL_GRACE_S) and its run closed: KILLED when regraft was
        interrupted, FAILED when another stage failed."""
        for item in self.running.values():
            self.launcher.cancel(item.job)
        self.launcher.stop([item.job for item in self.running.values()], CANCEL_GRACE_S)
        for item in self.running.values():
            reason = "cancelled: regraft was interrupted" if interrupted else "cancelled: another stage failed"
            self.finish_run(item.run_id, reason, item.job.job_id, status="KILLED" if interrupted else "FAILED")

    def finish_run(self, run_id: str | None, error: str, *args: Any, **kwargs: Any) -> None:
        """A node's run, when it has one, closed without an outcome: its error (StageTracker.finish_stage)."""
        if self.tracker is not None and run_id:
            self.tracker.finish_stage(run_id, None, error, *args, **kwargs)
