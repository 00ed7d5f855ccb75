"""What a dispatched job runs: one stage on its resolved config, under the stage's lock.

Submitit pickles `run_stage` by reference, so a job needs nothing but this repository on its path. The job checks
the cache again under the lock: a sweep member that started the same stage first leaves a complete output, and
this one reports a hit instead of running it twice.
"""
from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pipelines.cache import is_complete, stage_lock, sweep_leftovers
from stages.common.artifacts import read_manifest


@dataclass
class StageOutcome:
    out: str
    hit: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    headline: str = ""
    seconds: float = 0.0


def stage_config(stage: str, config: dict[str, Any]):
    """The stage's schema merged with the config, so a job re-checks every key and type it was handed."""
    module = importlib.import_module(f"stages.{stage}")  # importing registers the schema
    schema = ConfigStore.instance().load(f"schema/{stage}.yaml").node
    return module, OmegaConf.merge(schema, config)


def outcome_from_manifest(out: Path, hit: bool, seconds: float) -> StageOutcome:
    manifest = read_manifest(out) or {}
    return StageOutcome(str(out), hit, manifest.get("metrics", {}), manifest.get("headline", ""), seconds)


def run_stage(stage: str, config: dict[str, Any]) -> StageOutcome:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(config["out"])
    with stage_lock(out):
        if is_complete(out):
            return outcome_from_manifest(out, hit=True, seconds=0.0)
        sweep_leftovers(out)
        module, cfg = stage_config(stage, config)
        start = time.perf_counter()
        result = module.run(cfg)
        seconds = time.perf_counter() - start
    return StageOutcome(str(out), False, dict(result.metrics), result.headline, seconds)
