"""The pipeline of one invocation (or sweep member): the DAG built from the config, checked before any work, run
from the cache or as jobs (or raced, pipeline.race), tracked, and finished with its summary and plots.

`regraft` (pipelines/regraft.py) is the command around it; a sweep (pipelines/sweep.py) starts and finishes its
members with the same pieces: `get_ready`, `closing_on_failure`, `finish_run`.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig
from rich.console import Console

import pipelines.schema  # noqa: F401  (registers the root schema and, through it, every stage's)
from pipelines.core.cache import CacheCheck, keys_for
from pipelines.core.data_sets import settle_data
from pipelines.core.dag import PHASE1, Node, build_nodes, measurement
from pipelines.core.runner import NodeResult, pending, run_dag
from pipelines.launch.base import Launcher
from pipelines.launch.make import make_launcher
from pipelines.modes.preflight import check_before_any_work, engine_version_warnings
from pipelines.modes.race import race_summary, race_table, rung_runner, run_race
from pipelines.report.summary import finish_run
from pipelines.tracking.links import run_link
from pipelines.tracking.run_names import hydra_invocation
from pipelines.tracking.tracker import Tracker
from stages.common.contract.runtime import compute_as_every_cpu


@dataclass
class PipelineResult:
    results: dict[str, NodeResult]  # by node name, in DAG order
    summary: dict  # what summary.json holds
    plots: list[Path]
    mlflow_ui: str | None = None  # the command that opens the MLflow UI on this run's store
    mlflow_link: str | None = None  # the runs table there, filtered to the pipelines' parent runs, best first
    mlflow_run: str | None = None  # this run's parent run page there, in the classic (machine learning) view


def threads_per_stage(threads: int | None, max_parallel: int | None) -> int | None:
    if threads or not max_parallel:
        return threads
    return max(1, (os.cpu_count() or 1) // max_parallel)


def limit_threads(threads: int | None) -> None:
    """Intra-op threads of every stage: jobs inherit OMP_NUM_THREADS; inline stages use this process's setting.

    Stages running side by side on a few cores must not each start a thread per core: oversubscribed torch
    parallel regions wait on descheduled threads and run many times slower.
    """
    if not threads:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)  # torch reads it when first imported
    torch = sys.modules.get("torch")
    if torch is not None:  # imported already (a test session, say): set it now; else none is loaded for a warm rerun
        torch.set_num_threads(threads)


def get_ready(launcher: Launcher, cfg: DictConfig, nodes: list[Node], keys: dict[str, str]) -> None:
    """The threads each stage may use, and a warm interpreter already importing for the stages that will run (while
    MLflow starts): what a run and a sweep do before their first stage."""
    limit_threads(threads_per_stage(cfg.launcher.threads, cfg.launcher.max_parallel))
    launcher.prepare(pending(nodes, keys, Path(cfg.paths.cache)))


@contextlib.contextmanager
def closing_on_failure(trackers: list[Tracker | None]) -> Iterator[None]:
    """Whatever ends the stages early, every parent run is closed: KILLED when interrupted, else FAILED."""
    try:
        yield
    except BaseException as exc:
        for tracker in trackers:
            if tracker is not None:
                tracker.finish("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED", {}, {}, [])
        raise


def run_pipeline(cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console | None = None
                 ) -> PipelineResult:
    """Every stage of the DAG, from the cache or run; MLflow runs closed with the right status whatever happens.

    Raises RegraftError for bad input or a failed stage, KeyboardInterrupt when interrupted.
    """
    start, console = time.perf_counter(), console or Console()
    run_dir.mkdir(parents=True, exist_ok=True)
    compute_as_every_cpu()  # every stage computes as on any x86 CPU (contract/runtime.py); its jobs inherit it
    settle_data(cfg)  # named sets (mtbench, sharegpt, ...) as chat JSONL in the cache, before any stage
    nodes = build_nodes(cfg)
    launcher = make_launcher(cfg.launcher, run_dir / "jobs")
    check_before_any_work(cfg, nodes, launcher)
    for line in engine_version_warnings(nodes):  # a warning: the run goes on (pipelines/modes/preflight.py)
        console.print(line, markup=False, highlight=False)
    keys = keys_for(nodes)
    get_ready(launcher, cfg, nodes, keys)
    # named by the overrides its sweep varies (`lr=1e-3 init=remap`), else its own or `defaults`
    tracker = Tracker.for_pipeline(cfg.tracking, hydra_invocation(overrides, run_dir), overrides, run_dir)
    with closing_on_failure([tracker]):
        if cfg.pipeline.race:
            results, race = race_then_evaluate(cfg, launcher, tracker, console)
        else:
            results, race = run_dag(nodes, Path(cfg.paths.cache), launcher, tracker, console, cfg.launcher.poll_s,
                                    cfg.launcher.max_parallel, keys, check=CacheCheck.of(cfg.cache)), None
    summary, plots = finish_run(run_dir, results, cfg, overrides, time.perf_counter() - start, tracker, race=race)
    link = tracker.runs_link() if tracker else None
    parent = tracker.parent_id if link else None
    return PipelineResult(results, summary, plots, tracker.ui_command() if tracker else None, link,
                          run_link(link, parent) if parent else None)


def evaluated_turns(out: str) -> list[dict]:
    """An evaluation's rows (per_prompt.csv: conversation, turn, completion_tokens, verify_steps, ...)."""
    import csv

    path = Path(out) / "per_prompt.csv"
    return list(csv.DictReader(path.open())) if path.exists() else []


def race_then_evaluate(cfg: DictConfig, launcher, tracker, console: Console) -> tuple[dict[str, NodeResult], dict]:
    """pipeline.race: the rungs (pipelines/modes/race.py), each a run of cached nodes; then the winner evaluated as phase 1."""
    run_rungs = rung_runner(cfg, launcher, tracker, console)
    nodes, results, outcome = run_race(cfg, run_rungs)
    if cfg.pipeline.evaluate:  # every finalist measured as phase 1 is; the one that accepts more is phase 1
        names = [f"{finalist.candidate.name}_evaluate" for finalist in outcome.finalists]
        evaluations = [node for name, finalist in zip(names, outcome.finalists)
                       for node in measurement(cfg, name, finalist.result.out, "race")]
        results.update(run_rungs(evaluations, results))
        for name, finalist in zip(names, outcome.finalists):
            finalist.accept_len = results[name].metrics.get("accept_len")
            finalist.per_request = results[name].metrics.get("accept_len_per_request")
            finalist.per_set = {key.removeprefix("accept_len/"): value for key, value in results[name].metrics.items()
                                if key.startswith("accept_len/")}
            finalist.turns = evaluated_turns(results[name].out)
        outcome.decide()
        # the winner's own evaluation again under phase 1's name: the same node config, so a cache hit
        results.update(run_rungs(measurement(cfg, PHASE1.evaluate, outcome.winner.result.out, PHASE1.phase),
                                 results))
    console.print(race_table(outcome))
    summary = race_summary(outcome, cfg.race.budget_steps)
    console.print(f"race: {summary['decision']}", highlight=False, soft_wrap=True)
    return results, summary
