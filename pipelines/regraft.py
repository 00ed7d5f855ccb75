"""regraft: one command from an existing drafter and a new target to a remapped drafter, with the numbers.

Today's pipeline (in process): world (when the config uses the built-in example) -> vocab_map (new target's
data) -> compare (source drafter's map vs the new map) -> remap. Each stage writes its own folder under the run
directory; the run ends with a summary table and `summary.json`.

    regraft                                  # the built-in example, about a minute on a laptop
    regraft remap.fallback=mean vocab_map.draft_vocab_size=512
    python -m pipelines.regraft --cfg job    # print the composed config
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hydra
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

import pipelines.schema  # noqa: F401  (registers the pipeline-level schemas)
from stages import compare, features, finetune, remap, vocab_map, world  # noqa: F401  (schemas)
from stages.common.artifacts import plain_config, read_manifest, write_json_atomic
from stages.common.cli import CONF_DIR, StageResult
from stages.common.errors import RegraftError


def stage_config(group: DictConfig, **inputs: str) -> DictConfig:
    """A stage's own config with its inputs wired in, unless the user set them."""
    cfg = group.copy()
    for key, value in inputs.items():
        if OmegaConf.is_missing(cfg, key) or cfg[key] is None:
            cfg[key] = value
    return cfg


def ensure_world(cfg: DictConfig) -> StageResult | None:
    """Build the example world once per world config; reuse it while its manifest matches."""
    if not (cfg.target.builtin or cfg.source.builtin or cfg.data.builtin):
        return None
    world_cfg = stage_config(cfg.world, out=cfg.paths.world)
    manifest = read_manifest(world_cfg.out)
    if manifest and manifest.get("config") == plain_config(world_cfg):
        return StageResult(Path(world_cfg.out), manifest.get("metrics", {}), "reused")
    return world.run(world_cfg)


def check_given_inputs(cfg: DictConfig) -> None:
    """Fail before any work when a user-given input is absent (built-in ones appear with the world)."""
    for group, key in (("target", "path"), ("source", "path"), ("data", "train")):
        if not cfg[group].builtin and not Path(cfg[group][key]).exists():
            raise RegraftError(cfg[group][key], f"{group}.{key} does not exist",
                               f"point {group}.{key}= at it, or use the built-in example ({group}=toy)")


def run_pipeline(cfg: DictConfig, run_dir: Path) -> dict[str, StageResult]:
    check_given_inputs(cfg)
    results: dict[str, StageResult] = {}
    timings: dict[str, float] = {}

    def timed(name: str, fn, stage_cfg: DictConfig) -> StageResult:
        start = time.perf_counter()
        results[name] = fn(stage_cfg)
        timings[name] = time.perf_counter() - start
        return results[name]

    start = time.perf_counter()
    if (built := ensure_world(cfg)) is not None:
        results["world"], timings["world"] = built, time.perf_counter() - start
    new_map = timed("vocab_map", vocab_map.run, stage_config(
        cfg.vocab_map, tokenizer=cfg.target.path, data=cfg.data.train, out=str(run_dir / "vocab_map")))
    timed("compare", compare.run, stage_config(cfg.compare, a=cfg.source.path, b=str(new_map.out),
                                               out=str(run_dir / "compare")))
    timed("remap", remap.run, stage_config(cfg.remap, drafter=cfg.source.path, vocab_map=str(new_map.out),
                                           verifier=cfg.target.path, out=str(run_dir / "remap")))
    for name, seconds in timings.items():
        results[name].metrics["seconds"] = round(seconds, 2)
    return results


def print_summary(results: dict[str, StageResult], console: Console) -> None:
    table = Table(title="regraft summary")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("result")
    for name, result in results.items():
        table.add_row(name, f"{result.metrics.get('seconds', 0):.1f}", result.headline)
    console.print(table)
    for name, result in results.items():
        console.print(f"{name:>10}: {result.out}", highlight=False)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_dir = Path(cfg.paths.run)
    console = Console()
    try:
        results = run_pipeline(cfg, run_dir)
    except RegraftError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    summary = {name: {"out": str(r.out), "headline": r.headline, "metrics": r.metrics} for name, r in results.items()}
    write_json_atomic(run_dir / "summary.json", {"config": plain_config(cfg), "stages": summary})
    print_summary(results, console)
    console.print(f"summary: {run_dir / 'summary.json'}")


if __name__ == "__main__":
    main()
