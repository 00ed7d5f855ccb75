"""MLflow tracking: an experiment per pipeline, a parent run per invocation (per sweep member), a child run per stage.

The orchestrator logs everything from what the stages wrote (manifest, metrics.jsonl, reports), so jobs need no
tracking access, a cached stage's child run carries the original numbers, and a requeued fine-tune never logs a
step twice (its metrics.jsonl is rewritten on resume). Big files are recorded by path and sha256, not copied.
"""
from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipelines.dag import Node
from pipelines.jobs import StageOutcome
from stages.common.artifacts import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".bin")


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: value}


def numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(out: Path) -> dict[str, str]:
    """sha256 of a completed output's big files, computed once and kept beside the (immutable) output."""
    sidecar = out.with_name(out.name + ".sha256.json")
    if sidecar.exists():
        return json.loads(sidecar.read_text())
    hashes = {p.relative_to(out).as_posix(): sha256(p) for p in sorted(out.rglob("*"))
              if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES}
    write_json_atomic(sidecar, hashes)
    return hashes


def step_metrics(out: Path) -> list[tuple[str, float, int]]:
    """(key, value, step) from a stage's per-step logs: finetune's metrics.jsonl, the probe's per-turn table."""
    rows: list[tuple[str, float, int]] = []
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            split, step = record.pop("split"), int(record.pop("step"))
            rows += [(f"{split}.{key}", float(value), step) for key, value in record.items() if numeric(value)]
    if (out / "per_prompt.csv").exists():
        for step, record in enumerate(csv.DictReader((out / "per_prompt.csv").open())):
            rows += [(f"turn.{key}", float(record[key]), step) for key in ("accept_len", "completion_tokens")]
    return rows


class Tracker:
    def __init__(self, cfg: DictConfig, run_name: str, tags: dict[str, str]):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.cfg = cfg
        mlflow.set_tracking_uri(cfg.uri)
        self.client = MlflowClient(cfg.uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        self.experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            cfg.experiment, artifact_location=Path(cfg.artifact_location).absolute().as_uri())
        self.commit = git_commit()
        parent = self.client.create_run(self.experiment_id, run_name=run_name,
                                        tags={**tags, "git_commit": self.commit, "kind": "pipeline"})
        self.parent_id = parent.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key[:250], str(value)[:6000]) for key, value in flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start:start + 100])

    def log_metrics(self, run_id: str, rows: list[tuple[str, float, int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value, step in rows]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[start:start + 1000])

    def start_stage(self, node: Node, key: str, config: DictConfig, hit: bool) -> str:
        tags = {"mlflow.parentRunId": self.parent_id, "stage": node.stage, "node": node.name, "phase": node.phase,
                "cache_key": key, "cache_hit": str(hit).lower(), "git_commit": self.commit}
        run = self.client.create_run(self.experiment_id, run_name=node.name, tags=tags)
        self.log_params(run.info.run_id, OmegaConf.to_container(config, resolve=True, enum_to_str=True))
        return run.info.run_id

    def finish_stage(self, run_id: str, outcome: StageOutcome | None, error: str | None = None,
                     job_id: str = "", log: str = "", status: str = "FAILED", versions_note: str = "") -> None:
        """A stage's results into its child run; without an outcome, `error` and `status` (FAILED or KILLED)."""
        if job_id:
            self.client.set_tag(run_id, "job_id", job_id)
        if versions_note:
            self.client.set_tag(run_id, "versions_differ", versions_note)
        if log:
            self.client.set_tag(run_id, "job_log", log)
        if outcome is None:
            self.client.set_tag(run_id, "error", (error or "")[:5000])
            self.client.set_terminated(run_id, status)
            return
        out = Path(outcome.out)
        self.client.set_tag(run_id, "cache_hit", str(outcome.hit).lower())
        self.client.set_tag(run_id, "out", str(out))
        final = [(key, float(value), 0) for key, value in outcome.metrics.items() if numeric(value)]
        self.log_metrics(run_id, final + [("stage_seconds", outcome.seconds, 0)] + step_metrics(out))
        self.log_files(run_id, out)
        self.client.set_terminated(run_id, "FINISHED")

    def log_files(self, run_id: str, out: Path) -> None:
        limit = self.cfg.max_artifact_mb * 2**20
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            relative = path.relative_to(out)
            is_checkpoint = path.suffix in CHECKPOINT_SUFFIXES
            if (is_checkpoint and not self.cfg.copy_checkpoints) or path.stat().st_size > limit:
                continue
            self.client.log_artifact(run_id, str(path), artifact_path=relative.parent.as_posix()
                                     if relative.parent != Path(".") else None)
        for name, digest in file_hashes(out).items():
            self.client.set_tag(run_id, f"sha256.{name}"[:250], digest)
            self.client.set_tag(run_id, f"path.{name}"[:250], str(out / name))

    def finish(self, status: str, params: dict[str, Any], metrics: dict[str, float], files: list[Path]) -> None:
        self.log_params(self.parent_id, params)
        self.log_metrics(self.parent_id, [(key, float(value), 0) for key, value in metrics.items() if numeric(value)])
        for path in files:
            if path.exists():
                self.client.log_artifact(self.parent_id, str(path))
        self.client.set_terminated(self.parent_id, status)

    def ui_command(self) -> str:
        return f"mlflow ui --backend-store-uri {self.cfg.uri}"
