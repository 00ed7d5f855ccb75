"""regraft: one command from an existing drafter and a new target to phase 0 vs phase 1 numbers.

The config (conf/config.yaml) becomes a DAG of stages (pipelines/core/dag.py); complete outputs are reused from the
content-addressed cache, the rest run as submitit jobs (launcher=local|slurm|inline), every stage is a child run
of this invocation's MLflow run, and the run ends with a table, `summary.json` and plots in the run folder.

    regraft                                          # the built-in example: world, probe, remap, finetunes, evaluate
    regraft finetune.lr=1e-3 remap.fallback=mean     # any stage option
    regraft -m finetune.lr=1e-3,3e-3 finetune.init=remap,scratch   # a sweep; shared stages run once
    regraft debug=tiny                              # the whole pipeline in about a minute (conf/debug/tiny.yaml)
    regraft launcher=inline                          # every stage in this process (debugging)
    python -m pipelines.regraft --cfg job            # print the composed config

This module is the command: Hydra's composition, signals, the terminal, exit codes. The pipeline it runs is
`run_pipeline` (pipelines/pipeline.py), which tests call directly.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NoReturn

from stages.common.contract.runtime import set_process_defaults

set_process_defaults()

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

import pipelines.schema  # noqa: F401  (registers the root schema and, through it, every stage's)
from pipelines.config_errors import check_group_choices, composition_error, is_composition_failure
from pipelines.core.jobs import StageFailed
from pipelines.core.runner import Interrupts
from pipelines.modes.plan import plan_pipeline
from pipelines.pipeline import run_pipeline
from pipelines.report.summary import stage_table, story_caption, story_table
from stages.common.contract.errors import RegraftError, disk_full, said_disk_full
from stages.common.contract.stage import CONF_DIR


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
    if isinstance(exc, OmegaConfBaseException):  # a setting a stage's schema refused once composed (pipelines/core/dag.py)
        exc = composition_error(exc)
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
        if cfg.pipeline.plan:
            problems = plan_pipeline(cfg, run_dir, console)["problems"]
        else:
            done = run_pipeline(cfg, run_dir, list(HydraConfig.get().overrides.task), console)
    except BaseException as exc:  # noqa: BLE001 (one line and an exit code, whatever ended it)
        report_and_exit(exc, console, run_dir)
    if cfg.pipeline.plan:
        if problems:
            say_error(console, f"{len(problems)} problem(s) above: the run would stop at the first")
            sys.exit(1)
        return
    console.print(stage_table(done.results))
    console.print(story_table(done.summary["numbers"], caption=story_caption(done.summary)))
    if done.mlflow_ui:
        console.print(f"MLflow: {done.mlflow_ui}", highlight=False)
        if done.mlflow_link:  # none while the store does not answer (the run said so)
            console.print(f"which run won: {done.mlflow_link}", highlight=False, soft_wrap=True)
        if done.mlflow_run:
            console.print(f"this run: {done.mlflow_run}", highlight=False, soft_wrap=True)
    console.print(f"summary: {run_dir / 'summary.json'}", highlight=False)


if __name__ == "__main__":
    main()
