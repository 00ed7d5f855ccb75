"""The MLflow store's side of tracking: what a stage's output folder holds as params, metrics and artifacts, the
sqlite store created and migrated once under a lock, and StoreWriter, which applies the Tracker's queued records
(pipelines/tracking/outbox.py sends them from its own thread)."""
from __future__ import annotations

import contextlib
import csv
import json
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator

from omegaconf import DictConfig

from stages.common.contract.artifacts import read_manifest, sha256_of
from stages.common.contract.errors import RegraftError

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".bin")


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: value}


def numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def checkpoint_hashes(out: Path) -> dict[str, str]:
    """sha256 of an output's checkpoint files as they are now (a hit was checked against its manifest, and a file
    may have changed since any earlier run recorded it)."""
    return {p.relative_to(out).as_posix(): sha256_of(p) for p in sorted(out.rglob("*"))
            if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES}


SERIES_PREFIXES = ("train", "val", "preflight", "eval")  # metrics.jsonl splits, and the manifest keys that are their points


def metric_name(key: str, split: str | None = None) -> str:
    """A stage figure's one name: `val_loss` (manifest) and `loss` of a `val` line (metrics.jsonl) are `val/loss`,
    `preflight_full_acc_0` in either place is `preflight/full_acc_0`; anything else keeps its name."""
    if split is not None:
        return f"{split}/{key.removeprefix(split + '_')}"
    prefix, _, rest = key.partition("_")
    return f"{prefix}/{rest}" if prefix in SERIES_PREFIXES and rest else key


def step_metrics(out: Path) -> list[tuple[str, float, int]]:
    """(name, value, step) from a stage's per-step logs: finetune's metrics.jsonl by optimizer step
    (`train/loss`, `val/full_acc_0`, `preflight/full_acc_0`), the probe's per-turn table (`turn/accept_len`)."""
    rows: list[tuple[str, float, int]] = []
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            split, step = record.pop("split"), int(record.pop("step"))
            rows += [(metric_name(key, split), float(value), step) for key, value in record.items() if numeric(value)]
    if (out / "per_prompt.csv").exists():
        for step, record in enumerate(csv.DictReader((out / "per_prompt.csv").open())):
            rows += [(f"turn/{key}", float(record[key]), step) for key in ("accept_len", "completion_tokens")
                     if key in record]
    return rows


def stage_metrics(metrics: dict[str, Any], out: Path) -> list[tuple[str, float, int]]:
    """A stage's figures and its series, each under one name: a figure that is a point of a series is not logged
    again (the exported drafter's `val_*` are the best `val/*` point, the guard's figures the `preflight/*` line)."""
    series = step_metrics(out)
    logged = {name for name, _, _ in series}
    final = [(metric_name(key), float(value), 0) for key, value in metrics.items() if numeric(value)]
    return [row for row in final if row[0] not in logged] + series


def computed_at(out: Path) -> str:
    """Which computation of an output this is: its manifest's `finished_at` (a recomputation, after the cache was
    cleared, is another one and is uploaded again)."""
    return str((read_manifest(out) or {}).get("finished_at", ""))


def manifest_seconds(out: Path) -> float | None:
    manifest = read_manifest(out) or {}
    if numeric(manifest.get("started_at")) and numeric(manifest.get("finished_at")):
        return max(0.0, manifest["finished_at"] - manifest["started_at"])
    return None


def sqlite_file(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """A sqlite store's creation and migration are one writer's: a file lock beside the db (`mlflow.db.lock`)."""
    path = sqlite_file(uri)
    if path is None:
        yield
        return
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield


def repair_store(uri: str) -> None:
    """Called under store_lock: a sqlite store that an earlier run left half-created or half-migrated (tables but
    not this mlflow's schema revision) is migrated to it; one that cannot be ends the run with one line."""
    path = sqlite_file(uri)
    if path is None or not path.exists() or path.stat().st_size == 0:
        return  # a new store: mlflow creates it, once, under the lock
    import sqlalchemy
    from mlflow.store.db import utils as db

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        tables = set(sqlalchemy.inspect(engine).get_table_names()) - {"alembic_version"}
        if not tables:
            return
        head, current = db._get_latest_schema_revision(), db._get_schema_version(engine)
        if current == head and db._all_tables_exist(engine):
            return
        try:
            if current is None:  # killed between creating the first tables and recording the schema
                db._initialize_tables(engine)
            else:
                db._upgrade_db(engine)
        except Exception as exc:
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise RegraftError(path, f"the MLflow store is not at this mlflow's schema (found {current}, expected "
                               f"{head}) and could not be migrated: {first}",
                               f"move it aside (mv {path} {path}.broken) and rerun, which starts a new store; or "
                               f"repair it with `mlflow db upgrade sqlite:///{path}`") from None
    finally:
        engine.dispose()


EXPERIMENT_NOTE = """regraft: one parent run per invocation (per sweep member), named by the overrides its sweep \
varies (`lr=1e-3 init=remap`), or a single run by its overrides (or `defaults`) and when it started; one child run \
per stage.

Which setting won: sort the parent runs by **phase1/accept_len** (the remapped, fine-tuned drafter on the new \
target), against **phase0/accept_len** (the source drafter as it is) and **scratch/accept_len** (the same fine-tune \
from scratch); **gain/over_scratch** and **gain/over_phase0** are the differences. Beside them: phase1/val_acc_0 \
and scratch/val_acc_0 (the exported drafters' validation accuracy at TTT step 0), phase0|phase1|scratch/loss_0 \
(step-0 loss before training), and stages/ran, stages/hit (cache). A member whose fine-tune is the \
scratch baseline (finetune.init=scratch) has tag phase1_is_scratch=true and no /scratch figures.
"""


class StoreWriter:
    """What reaches the store: each record a Tracker queued, applied in order by the outbox's one thread (or by a
    replay in a later process). Handles (`h<n>`) name runs before the store gave them ids; `ids` maps them."""

    def __init__(self, client: Any, cfg: DictConfig, experiment_id: str):
        self.client, self.cfg, self.experiment_id = client, cfg, experiment_id

    def apply(self, record: dict[str, Any], ids: dict[str, str]) -> None:
        getattr(self, record["op"])(ids, record["at"], **record["args"])

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key[:250], str(value)[:6000]) for key, value in flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start:start + 100])

    def log_metrics(self, run_id: str, rows: list[tuple[str, float, int]], at: int) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, at, step) for key, value, step in rows]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[start:start + 1000])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(key[:250], str(value)[:5000]) for key, value in tags.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, tags=items[start:start + 100])

    # --- the records' operations ---------------------------------------------------------------------------------

    def create_run(self, ids: dict[str, str], at: int, handle: str, name: str, tags: dict[str, str],
                   parent: str | None = None, params: dict[str, Any] | None = None) -> None:
        if parent is not None:
            tags = {**tags, "mlflow.parentRunId": ids[parent]}
        run = self.client.create_run(self.experiment_id, start_time=at, run_name=name[:250], tags=tags)
        ids[handle] = run.info.run_id
        if params:
            self.log_params(run.info.run_id, params)

    def finish_stage(self, ids: dict[str, str], at: int, handle: str, stage: str, key: str,
                     outcome: dict[str, Any] | None, error: str | None, tags: dict[str, str], status: str) -> None:
        run_id = ids[handle]
        if outcome is None:  # it made no output, so nothing was a hit: `pending` must not outlive the run
            self.set_tags(run_id, {**tags, "cache_hit": "false", "error": (error or "")[:5000]})
            self.client.set_terminated(run_id, status, end_time=at)
            return
        out = Path(outcome["out"])
        tags = {**tags, "cache_hit": str(outcome["hit"]).lower(), "out": str(out)}
        for name, digest in checkpoint_hashes(out).items():
            tags[f"sha256.{name}"] = digest
            tags[f"path.{name}"] = str(out / name)
        rows = stage_metrics(outcome["metrics"], out)
        tags["computed_at"] = computed_at(out)
        # The run that computed an output does not wait for others, but it too checks under the lock: its own
        # records may reach the store after a hit's (each run's outbox sends in its own time), and then the hit
        # uploaded first.
        uploader = self.run_with_artifacts_or_upload(run_id, stage, key, out, wait_s=60.0 if outcome["hit"] else 0.0)
        if outcome["hit"]:
            seconds, tags["stage_seconds_from"] = self.original_seconds(uploader, out)
        else:
            seconds = outcome["seconds"]
        tags.update(artifacts_run=uploader.info.run_id if uploader else run_id,
                    artifacts="uploaded" if uploader is None else f"in run {uploader.info.run_id} (uploaded first)")
        if seconds is not None:
            rows.append(("stage_seconds", float(seconds), 0))
        self.log_metrics(run_id, rows, at)
        self.set_tags(run_id, tags)  # `artifacts=uploaded` last: what a hit in another run looks for
        self.client.set_terminated(run_id, "FINISHED", end_time=at)

    def finish_parent(self, ids: dict[str, str], at: int, handle: str, status: str, params: dict[str, Any],
                      metrics: dict[str, float], tags: dict[str, str], files: list[str],
                      same_computation: dict[str, str]) -> None:
        run_id = ids[handle]
        for child, names in same_computation.items():
            self.client.set_tag(ids[child], "same_computation_as", names)
        self.log_params(run_id, params)
        self.log_metrics(run_id, [(key, float(value), 0) for key, value in metrics.items()], at)
        if tags:
            self.set_tags(run_id, tags)
        for path in files:
            if Path(path).exists():
                self.client.log_artifact(run_id, path)
        self.client.set_terminated(run_id, status, end_time=at)

    # --- cache hits: one upload per output per store -------------------------------------------------------------

    def run_with_artifacts(self, stage: str, key: str, computation: str) -> Any:
        """The child run that holds the artifacts of this computation of a stage output, if any run in this store
        uploaded them."""
        runs = self.client.search_runs([self.experiment_id], f"tags.stage = '{stage}' and tags.cache_key = '{key}' "
                                       f"and tags.computed_at = '{computation}' and tags.artifacts = 'uploaded'",
                                       max_results=1, order_by=["start_time ASC"])
        return runs[0] if runs else None

    def others_pending(self, run_id: str, stage: str, key: str) -> bool:
        """Whether another run's job for this output may have computed it and not yet logged it (its child run is
        still running with `cache_hit=pending`, started within the day)."""
        since = int((time.time() - 86400) * 1000)
        runs = self.client.search_runs([self.experiment_id], f"tags.stage = '{stage}' and tags.cache_key = '{key}' "
                                       f"and tags.cache_hit = 'pending' and attributes.status = 'RUNNING' "
                                       f"and attributes.start_time > {since}", max_results=10)
        return any(run.info.run_id != run_id for run in runs)

    def run_with_artifacts_or_upload(self, run_id: str, stage: str, key: str, out: Path, wait_s: float = 60.0) -> Any:
        """The run that holds a cached output's artifacts; None after this run uploaded them, as the first in this
        store. A run that computed the output at the same time is waited for (up to `wait_s`), so its upload is
        the only one; the lock beside the output makes the check and the upload one step among regraft runs."""
        from filelock import FileLock

        deadline = time.monotonic() + wait_s
        while True:
            with FileLock(str(out.with_name(out.name + ".mlflow.lock"))):
                uploader = self.run_with_artifacts(stage, key, computed_at(out))
                if uploader is not None:
                    return uploader
                if time.monotonic() >= deadline or not self.others_pending(run_id, stage, key):
                    self.log_files(run_id, out)
                    self.set_tags(run_id, {"artifacts_run": run_id, "artifacts": "uploaded",
                                           "computed_at": computed_at(out)})
                    return None
            time.sleep(0.5)

    @staticmethod
    def original_seconds(uploader: Any, out: Path) -> tuple[float | None, str]:
        """A hit's `stage_seconds`: those of the run that computed it, else the manifest's span; and which."""
        if uploader is not None and uploader.data.tags.get("cache_hit") == "false" and \
                "stage_seconds" in uploader.data.metrics:
            return uploader.data.metrics["stage_seconds"], f"cache hit: the seconds of run {uploader.info.run_id}, " \
                                                         "which computed it"
        seconds = manifest_seconds(out)
        return seconds, "cache hit: the original run's seconds, from its manifest" if seconds is not None else \
            "cache hit: the original seconds are unknown"

    def log_files(self, run_id: str, out: Path) -> None:
        limit = self.cfg.max_artifact_mb * 2**20
        for path in sorted(p for p in out.rglob("*") if p.is_file()):
            relative = path.relative_to(out)
            is_checkpoint = path.suffix in CHECKPOINT_SUFFIXES
            if (is_checkpoint and not self.cfg.copy_checkpoints) or path.stat().st_size > limit:
                continue
            self.client.log_artifact(run_id, str(path), artifact_path=relative.parent.as_posix()
                                     if relative.parent != Path(".") else None)


@dataclass
class OpenStore:
    """A store opened for writing (created or migrated first, once, under its lock): the client, the experiment's id
    and the writer that applies records."""

    client: Any
    experiment_id: str
    writer: StoreWriter

    @classmethod
    def of(cls, cfg: DictConfig) -> "OpenStore":
        import mlflow
        from mlflow.tracking import MlflowClient

        mlflow.set_tracking_uri(cfg.uri)
        with store_lock(cfg.uri):  # created and migrated once, by whichever run comes first
            repair_store(cfg.uri)
            client = MlflowClient(cfg.uri)
            experiment_id = experiment(client, cfg.experiment, Path(cfg.artifact_location).absolute().as_uri())
        return cls(client, experiment_id, StoreWriter(client, cfg, experiment_id))


def experiment(client: Any, name: str, artifact_location: str) -> str:
    """The experiment's id, created if absent (a run that loses the race to create it takes the winner's), tagged to
    open on its runs (MLflow 3 otherwise opens the GenAI overview) with a note on what to sort by."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:
            pass  # another run created it in between (a server store: no file lock)
        found = client.get_experiment_by_name(name)
    tags = found.tags
    if tags.get("mlflow.experimentKind") != "custom_model_development":
        set_experiment_tag(client, found.experiment_id, "mlflow.experimentKind", "custom_model_development")
    if "mlflow.note.content" not in tags:  # a description edited in the UI stays
        set_experiment_tag(client, found.experiment_id, "mlflow.note.content", EXPERIMENT_NOTE)
    return found.experiment_id


def set_experiment_tag(client: Any, experiment_id: str, key: str, value: str) -> None:
    """An experiment tag that runs started together may all set to the same value: the SQLite store inserts a new
    key, so the runs that lose the race fail on its UNIQUE constraint, and the winner's tag is theirs too."""
    from mlflow.exceptions import MlflowException

    try:
        client.set_experiment_tag(experiment_id, key, value)
    except MlflowException:
        if client.get_experiment(experiment_id).tags.get(key) is None:
            raise
