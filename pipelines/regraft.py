"""regraft: one command from an existing drafter and a new target to phase 0 vs phase 1 numbers.

The config (conf/config.yaml) becomes a DAG of stages (pipelines/dag.py); complete outputs are reused from the
content-addressed cache, the rest run as submitit jobs (launcher=local|slurm|inline), every stage is a child run
of this invocation's MLflow run, and the run ends with a table, `summary.json` and plots in the run folder.

    regraft                                          # the built-in example: world, probe, remap, finetunes, evaluate
    regraft finetune.lr=1e-3 remap.fallback=mean     # any stage option
    regraft -m finetune.lr=1e-3,3e-3 finetune.init=remap,scratch   # a sweep; shared stages run once
    regraft launcher=inline                          # every stage in this process (debugging)
    python -m pipelines.regraft --cfg job            # print the composed config
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

import pipelines.schema  # noqa: F401  (registers the pipeline-level schemas)
from pipelines.cache import keys_for
from pipelines.dag import REFERENCE, build_nodes
from pipelines.dispatch import make_launcher
from pipelines.runner import Interrupts, pending, run_dag
from pipelines.summary import headline_numbers, plot, stage_table, story_table, write_summary
from pipelines.tracking import Tracker
from stages import compare, evaluate, features, finetune, probe, remap, vocab_map, world  # noqa: F401  (schemas)
from stages.common.cli import CONF_DIR
from stages.common.errors import RegraftError
from stages.world import TINY_WORLD_OVERRIDES

# The whole pipeline at seconds scale, for tests and benchmarks: `regraft <these>` takes about a minute on 2 cores.
TINY_OVERRIDES = [f"world.{override}" for override in TINY_WORLD_OVERRIDES] + [
    "vocab_map.draft_vocab_size=128", "features.batch_size=8", "finetune.max_steps=4", "finetune.micro_batch_size=4",
    "finetune.ttt_steps=3", "finetune.max_length=64", "finetune.log_every=1", "probe.num_prompts=2",
    "probe.max_new_tokens=12"]


def check_given_inputs(cfg: DictConfig) -> None:
    """Fail before any work when a user-given input is absent (@world ones appear with the world)."""
    for group, key in (("target", "path"), ("source", "path"), ("data", "train"), ("data", "prompts")):
        value = cfg[group][key]
        if REFERENCE.match(value) or value == "builtin":
            continue
        if not Path(value).exists():
            raise RegraftError(value, f"{group}.{key} does not exist",
                               f"point {group}.{key}= at it, or use the built-in example ({group}=toy)")


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


def invocation_name(run_dir: Path) -> str:
    return "/".join(run_dir.parts[-2:]) if run_dir.parent.name not in ("runs",) else run_dir.name


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    start, console = time.perf_counter(), Console()
    run_dir = Path(cfg.paths.run)
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = list(HydraConfig.get().overrides.task)
    tracker = None
    # SIGTERM (`kill`, a scheduler ending regraft's own job) ends a run as Ctrl-C does: stage jobs are cancelled
    # (scancel on Slurm) and the MLflow runs marked KILLED, not left running with nobody to collect them
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, Interrupts.handler)
    try:
        check_given_inputs(cfg)
        nodes = build_nodes(cfg)
        limit_threads(threads_per_stage(cfg.launcher.get("threads"), cfg.launcher.get("max_parallel")))
        launcher = make_launcher(cfg.launcher, run_dir / "jobs")
        keys = keys_for(nodes)
        launcher.prepare(pending(nodes, keys, Path(cfg.paths.cache)))  # a warm interpreter imports while MLflow starts
        if cfg.tracking.enabled:
            tracker = Tracker(cfg.tracking, invocation_name(run_dir),
                              tags={"overrides": " ".join(overrides) or "(defaults)", "run_dir": str(run_dir)})
        results = run_dag(nodes, Path(cfg.paths.cache), launcher, tracker, console, cfg.launcher.poll_s,
                          cfg.launcher.get("max_parallel"), keys)
    except RegraftError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        if tracker is not None:
            tracker.finish("FAILED", {}, {}, [])
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("[red]interrupted:[/red] the running stages were cancelled; the same command resumes from "
                      "the complete ones", highlight=False)
        if tracker is not None:
            tracker.finish("KILLED", {}, {}, [])
        sys.exit(130)
    summary = write_summary(run_dir, results, OmegaConf.to_container(cfg, resolve=True), overrides,
                            time.perf_counter() - start)
    plots = plot(summary["stages"], run_dir)
    console.print(stage_table(results))
    console.print(story_table(summary["numbers"]))
    if tracker is not None:
        params = dict(override.split("=", 1) for override in overrides if "=" in override)
        tracker.finish("FINISHED", params, headline_numbers(summary["stages"]), [run_dir / "summary.json", *plots])
        console.print(f"MLflow: {tracker.ui_command()}", highlight=False)
    console.print(f"summary: {run_dir / 'summary.json'}", highlight=False)


if __name__ == "__main__":
    main()
