"""regraft: one command from an existing drafter and a new target to phase 0 vs phase 1 numbers.

The config (conf/config.yaml) becomes a DAG of stages (pipelines/dag.py); complete outputs are reused from the
content-addressed cache, the rest run as submitit jobs (launcher=local|slurm|inline), every stage is a child run
of this invocation's MLflow run, and the run ends with a table, `summary.json` and plots in the run folder.

    regraft                                          # the built-in example: world, probe, remap, finetunes, evaluate
    regraft finetune.lr=1e-3 remap.fallback=mean     # any stage option
    regraft -m finetune.lr=1e-3,3e-3 finetune.init=remap,scratch   # a sweep; shared stages run once
    regraft debug=tiny                              # the whole pipeline in about a minute (conf/debug/tiny.yaml)
    regraft launcher=inline                          # every stage in this process (debugging)
    python -m pipelines.regraft --cfg job            # print the composed config

`run_pipeline(cfg, ...)` is the pipeline itself (tests call it); `main` is the command around it: signals, the
terminal, exit codes.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

import pipelines.schema  # noqa: F401  (registers the root schema and, through it, every stage's)
from pipelines.cache import CacheCheck, keys_for
from pipelines.config_errors import check_group_choices, composition_error, is_composition_failure
from pipelines.dag import build_nodes, evaluate_node
from pipelines.race import race_summary, race_table, rung_runner, run_race
from pipelines.jobs import StageFailed
from pipelines.launchers import make_launcher
from pipelines.preflight import check_before_any_work
from pipelines.runner import Interrupts, NodeResult, pending, run_dag
from pipelines.summary import finish_run, stage_table, story_caption, story_table
from pipelines.tracking import Tracker, hydra_invocation
from stages.common.errors import RegraftError, disk_full, said_disk_full
from stages.common.runtime import same_on_every_cpu
from stages.common.stage import CONF_DIR


@dataclass
class PipelineResult:
    results: dict[str, NodeResult]  # by node name, in DAG order
    summary: dict  # what summary.json holds
    plots: list[Path]
    mlflow_ui: str | None = None  # the command that opens the MLflow UI on this run's store
    mlflow_link: str | None = None  # the runs table there, filtered to the pipelines' parent runs, best first


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
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def run_pipeline(cfg: DictConfig, run_dir: Path, overrides: list[str], console: Console | None = None
                 ) -> PipelineResult:
    """Every stage of the DAG, from the cache or run; MLflow runs closed with the right status whatever happens.

    Raises RegraftError for bad input or a failed stage, KeyboardInterrupt when interrupted.
    """
    start, console = time.perf_counter(), console or Console()
    run_dir.mkdir(parents=True, exist_ok=True)
    tracker = None
    try:
        same_on_every_cpu()  # every stage computes as on any x86 CPU (stages/common/runtime.py); its jobs inherit it
        nodes = build_nodes(cfg)
        launcher = make_launcher(cfg.launcher, run_dir / "jobs")
        check_before_any_work(cfg, nodes, launcher)
        limit_threads(threads_per_stage(cfg.launcher.threads, cfg.launcher.max_parallel))
        keys = keys_for(nodes)
        launcher.prepare(pending(nodes, keys, Path(cfg.paths.cache)))  # a warm interpreter imports while MLflow starts
        # named by the overrides its sweep varies (`lr=1e-3 init=remap`), else its own or `defaults`
        tracker = Tracker.for_pipeline(cfg.tracking, hydra_invocation(overrides), overrides, run_dir)
        if cfg.pipeline.race:
            results, race = race_then_evaluate(cfg, launcher, tracker, console)
        else:
            results, race = run_dag(nodes, Path(cfg.paths.cache), launcher, tracker, console, cfg.launcher.poll_s,
                                    cfg.launcher.max_parallel, keys, check=CacheCheck.of(cfg.cache)), None
    except BaseException as exc:
        if tracker is not None:
            tracker.finish("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED", {}, {}, [])
        raise
    summary, plots = finish_run(run_dir, results, cfg, overrides, time.perf_counter() - start, tracker, race=race)
    return PipelineResult(results, summary, plots, tracker.ui_command() if tracker else None,
                          tracker.runs_link() if tracker else None)


def race_then_evaluate(cfg: DictConfig, launcher, tracker, console: Console) -> tuple[dict[str, NodeResult], dict]:
    """pipeline.race: the rungs (pipelines/race.py), each a run of cached nodes; then the winner evaluated as phase 1."""
    run_rungs = rung_runner(cfg, launcher, tracker, console)
    nodes, results, outcome = run_race(cfg, run_rungs)
    if cfg.pipeline.evaluate:  # the winner is phase 1; the other family's finalist is measured the same way
        names = ["evaluate"] + [f"{finalist.candidate.name}_evaluate" for finalist in outcome.finalists[1:]]
        evaluations = [evaluate_node(cfg, name, finalist.result.out, "1" if name == "evaluate" else "race")
                       for name, finalist in zip(names, outcome.finalists)]
        results.update(run_rungs(evaluations, results))
        for name, finalist in zip(names, outcome.finalists):
            finalist.accept_len = results[name].metrics.get("accept_len")
    console.print(race_table(outcome))
    summary = race_summary(outcome, cfg.race.budget_steps)
    console.print(f"race: {summary['decision']}", highlight=False, soft_wrap=True)
    return results, summary


def report_and_exit(exc: BaseException, console: Console, run_dir: Path | None) -> NoReturn:
    """How a run (or a whole sweep) ends early: one line on the terminal, where the log is, an exit code.

    Never raises on the way: a full disk is said as one line naming the path, whatever filled first, and a crash
    whose traceback cannot be written to the run folder is still said in its one line.
    """
    if isinstance(exc, KeyboardInterrupt):
        console.print("[red]interrupted:[/red] the running stages were cancelled; the same command resumes from "
                      "the complete ones", highlight=False)
        sys.exit(130)
    if not isinstance(exc, Exception):  # SystemExit and the like: as they are
        raise exc
    exc = (stage_disk_full(exc) if isinstance(exc, StageFailed) else disk_full(exc, run_dir)) or exc
    if isinstance(exc, StageFailed):  # the stage's own line, then where its whole log is
        say_error(console, f"{exc.node}: {exc.line}")
        console.print(f"log: {exc.log}", highlight=False, soft_wrap=True)
        sys.exit(1)
    if isinstance(exc, RegraftError):
        say_error(console, str(exc))
        sys.exit(1)
    # not regraft's own: one line all the same, the traceback kept in the run folder
    log = write_traceback(exc, run_dir)
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    where = "the traceback is in the log below" if log else "its traceback could not be written"
    say_error(console, f"regraft crashed: {type(exc).__name__}: {first} (a bug: {where}; rerun to resume from the "
                       "complete stages)")
    if log:
        console.print(f"log: {log}", highlight=False, soft_wrap=True)
    sys.exit(1)


def say_error(console: Console, line: str) -> None:
    console.print(f"[red]error:[/red] {line}", highlight=False, soft_wrap=True)


def stage_disk_full(failed: StageFailed) -> RegraftError | None:
    """A stage that ended for a full disk, as that one line: the stage's own, or one naming its job's folder when
    the job could not leave it (its result or its log was the write that failed)."""
    if said_disk_full(failed.line):
        return RegraftError(None, failed.line)
    return disk_full(failed, Path(failed.log).parent if failed.log else None)


def write_traceback(exc: BaseException, run_dir: Path | None) -> Path | None:
    """regraft-error.log in the run folder (the temp folder before there is one); None when it cannot be written."""
    folder = run_dir or Path(tempfile.gettempdir())
    log = folder / ("regraft-error.log" if run_dir else f"regraft-error-{os.getpid()}.log")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(exc)))
    except OSError:
        with contextlib.suppress(OSError):
            log.unlink(missing_ok=True)  # a log cut short by a full disk would only mislead
        return None
    return log


def main() -> None:
    """The `regraft` command: Hydra's command line, whose every error ends with regraft's own `error:` line.

    Hydra reports a failure it catches (a bad override, a missing config option) in its own words and ends with
    its HYDRA_FULL_ERROR hint; with HYDRA_FULL_ERROR=1 it raises the exception instead, which regraft says here in
    one line: the key and the values or type it takes. Set by the user, HYDRA_FULL_ERROR=1 keeps Hydra's traceback.
    """
    sys.argv[1:] = flags_first(sys.argv[1:])
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        command()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    console = Console()
    try:
        command()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 (Hydra's own writes, a callback: one line and an exit code too)
        if is_composition_failure(exc):
            say_error(console, str(composition_error(exc)))
            sys.exit(1)
        report_and_exit(exc, console, hydra_output_dir())


def flags_first(arguments: list[str]) -> list[str]:
    """Hydra's flags before the overrides, each group in its order: Hydra's parser takes the overrides as one run,
    so `regraft a=1 -m b=1,2` or `regraft a=1 --cfg job b=2` would end in argparse's usage text, not a run."""
    def is_override(argument: str) -> bool:
        return not argument.startswith("-") and ("=" in argument or argument.startswith("~"))

    return [a for a in arguments if not is_override(a)] + [a for a in arguments if is_override(a)]


def hydra_output_dir() -> Path | None:
    """The run (or sweep member) folder Hydra was making when it failed, if it had got that far."""
    if not HydraConfig.initialized():
        return None
    folder = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", default=None)
    return Path(str(folder)) if folder else None


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def command(cfg: DictConfig) -> None:
    """One run: the pipeline, its tables, and where its results are (a sweep runs in hydra_plugins' launcher)."""
    console = Console()
    # SIGTERM (`kill`, a scheduler ending regraft's own job) ends a run as Ctrl-C does: stage jobs are cancelled
    # (scancel on Slurm) and the MLflow runs marked KILLED, not left running with nobody to collect them
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, Interrupts.handler)
    run_dir = Path(cfg.paths.run)
    try:
        check_group_choices(HydraConfig.get().runtime.choices, GlobalHydra.instance().config_loader())
        done = run_pipeline(cfg, run_dir, list(HydraConfig.get().overrides.task), console)
    except BaseException as exc:  # noqa: BLE001 (one line and an exit code, whatever ended it)
        report_and_exit(exc, console, run_dir)
    console.print(stage_table(done.results))
    console.print(story_table(done.summary["numbers"], caption=story_caption(done.summary)))
    if done.mlflow_ui:
        console.print(f"MLflow: {done.mlflow_ui}", highlight=False)
        if done.mlflow_link:  # none while the store does not answer (the run said so)
            console.print(f"which run won: {done.mlflow_link}", highlight=False, soft_wrap=True)
    console.print(f"summary: {run_dir / 'summary.json'}", highlight=False)


if __name__ == "__main__":
    main()
