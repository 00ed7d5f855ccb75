"""MLflow tracking: an experiment per pipeline, a parent run per invocation (per sweep member), a child run per stage.

The orchestrator logs everything from what the stages wrote (manifest, metrics.jsonl, reports), so jobs need no
tracking access, a cached stage's child run carries the original numbers, and a requeued fine-tune never logs a
step twice (its metrics.jsonl is rewritten on resume). Big files are recorded by path and sha256, not copied.

One name per metric (docs/mlflow.md):
- child runs: a stage's figures under its own names (`accept_len`, `shared_ids`, ...), per-step series as
  `train/<k>`, `val/<k>` (finetune, by optimizer step), `preflight/<k>` (the finetune guard, step 0) and
  `turn/<k>` (the probe, by turn); a final figure that is a point of a series (the exported drafter's `val_*`,
  the guard's `preflight_*`) is that series' point, not a second name; `stage_seconds` on every child.
- the parent run: a child's figure under its node's role, `phase0/accept_len`, `phase1/accept_len`,
  `scratch/accept_len`, `phase1/val_acc_0`, `phase0/loss_0` (the source lm_head as it is) ... (pipelines/summary.py
  `HEADLINES`: every name differs from the others in its first 12 characters, what MLflow's table shows), and
  `stages/ran`, `stages/hit`.
Runs are named by the overrides that vary in their sweep (`lr=1e-3 init=remap`), a single run by its overrides
(or `defaults`); the sweep's tags (`sweep`, `member`, each swept key) are on the parent and on every child.

A cache hit uploads no artifacts: its tag `artifacts_run` names the child run that holds them (the first one of the
stage's output in this store); its `stage_seconds` is the original run's, marked by the tag `stage_seconds_from`.
The sqlite store is created and migrated once, under a file lock beside it, so runs started together share it.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from pipelines.dag import Node
from pipelines.jobs import StageOutcome
from stages.common.artifacts import read_manifest, sha256_of
from stages.common.errors import RegraftError

# conf/config.yaml names run and sweep folders by time, microseconds and this process's id (`${regraft.pid:}`):
# two invocations started in the same second never share a folder
OmegaConf.register_new_resolver("regraft.pid", os.getpid, replace=True)

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


def checkpoint_hashes(out: Path) -> dict[str, str]:
    """sha256 of an output's checkpoint files as they are now (a hit was checked against its manifest, and a file
    may have changed since any earlier run recorded it)."""
    return {p.relative_to(out).as_posix(): sha256_of(p) for p in sorted(out.rglob("*"))
            if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES}


SERIES_PREFIXES = ("train", "val", "preflight")  # metrics.jsonl splits, and the manifest keys that are their points


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


def manifest_seconds(out: Path) -> float | None:
    manifest = read_manifest(out) or {}
    if numeric(manifest.get("started_at")) and numeric(manifest.get("finished_at")):
        return max(0.0, manifest["finished_at"] - manifest["started_at"])
    return None


# --- naming runs ---------------------------------------------------------------------------------------------------

NOT_IN_NAMES = ("paths.", "hydra.", "tracking.")  # overrides that say where, not what is computed


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def override_value(override: str) -> str:
    return override.split("=", 1)[1] if "=" in override else ""


def short_keys(keys: list[str]) -> dict[str, str]:
    """`finetune.lr` -> `lr`, unless another key ends the same way (then both stay whole)."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: short if last.count(short) == 1 else key for key, short in zip(keys, last)}


@dataclass
class Invocation:
    """What a parent run is called, and the tags it shares with its children."""

    name: str
    tags: dict[str, str] = field(default_factory=dict)


def invocation(overrides: list[str], swept: list[str] | None = None, sweep: str | None = None,
               member: int | None = None) -> Invocation:
    """A sweep member is named by its values of the swept keys (`lr=1e-3 init=remap`); a single run by its
    overrides except where-to-write ones, or `defaults`."""
    by_key = {override_key(override): override for override in overrides}
    if swept:
        named = [by_key[key] for key in swept if key in by_key]
    else:
        named = [override for override in overrides if not override_key(override).startswith(NOT_IN_NAMES)]
    short = short_keys([override_key(override) for override in named])
    name = " ".join(f"{short[override_key(o)]}={override_value(o)}" if "=" in o else o for o in named) or "defaults"
    tags: dict[str, str] = {}
    if sweep is not None:
        tags.update(sweep=sweep, member=str(member), swept=" ".join(swept or []) or "(nothing varies)")
        tags.update({override_key(o): override_value(o)[:5000] for o in named if swept})
    return Invocation(name[:250], tags)


def swept_keys(task: list[str], params: dict[str, Any] | None = None) -> list[str]:
    """The keys a sweep varies: its command-line overrides with several values (`finetune.lr=1e-3,3e-3`,
    `choice(...)`, `range(...)`), and the sweeper's `params` from the config."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [*task, *(f"{key}={value}" for key, value in (params or {}).items())]
    keys: list[str] = []
    for override in OverridesParser.create().parse_overrides(given):
        if override.is_sweep_override() and override.key_or_group not in keys:
            keys.append(override.key_or_group)
    return keys


def hydra_invocation(overrides: list[str]) -> Invocation:
    """This process's invocation as Hydra launched it: a sweep member (its sweep folder, number and the keys the
    sweep varies, read from the sweep's multirun.yaml) or a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return invocation(overrides)
    hydra = HydraConfig.get()
    sweep_dir = Path(hydra.sweep.dir)
    task, params = [], OmegaConf.to_container(hydra.sweeper.params) if hydra.sweeper.get("params") else {}
    if (sweep_dir / "multirun.yaml").exists():  # the sweep as given: `finetune.lr=1e-3,3e-3`, not this member's value
        given = OmegaConf.load(sweep_dir / "multirun.yaml").hydra
        task = list(given.overrides.task)
        params = OmegaConf.to_container(given.sweeper.params) if given.sweeper.get("params") else params
    return invocation(overrides, swept_keys(task, params), sweep_dir.name, hydra.job.num)


# --- the store -----------------------------------------------------------------------------------------------------

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
varies (`lr=1e-3 init=remap`) or `defaults`; one child run per stage.

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
        if outcome["hit"]:
            holder = self.artifacts_holder(run_id, stage, key, out)
            seconds, tags["stage_seconds_from"] = self.original_seconds(holder, out)
            tags.update(artifacts_run=holder.info.run_id if holder else run_id,
                        artifacts="uploaded" if holder is None else f"in run {holder.info.run_id} (cache hit)")
        else:
            seconds = outcome["seconds"]
            self.log_files(run_id, out)
            tags.update(artifacts_run=run_id, artifacts="uploaded")
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

    def holder(self, stage: str, key: str) -> Any:
        """The child run that holds the artifacts of this stage output, if any run in this store uploaded them."""
        runs = self.client.search_runs([self.experiment_id], f"tags.stage = '{stage}' and tags.cache_key = '{key}' "
                                       "and tags.artifacts = 'uploaded'", max_results=1, order_by=["start_time ASC"])
        return runs[0] if runs else None

    def others_pending(self, run_id: str, stage: str, key: str) -> bool:
        """Whether another run's job for this output may have computed it and not yet logged it (its child run is
        still running with `cache_hit=pending`, started within the day)."""
        since = int((time.time() - 86400) * 1000)
        runs = self.client.search_runs([self.experiment_id], f"tags.stage = '{stage}' and tags.cache_key = '{key}' "
                                       f"and tags.cache_hit = 'pending' and attributes.status = 'RUNNING' "
                                       f"and attributes.start_time > {since}", max_results=10)
        return any(run.info.run_id != run_id for run in runs)

    def artifacts_holder(self, run_id: str, stage: str, key: str, out: Path, wait_s: float = 60.0) -> Any:
        """The run that holds a cached output's artifacts; None after this run uploaded them, as the first in this
        store. A run that computed the output at the same time is waited for (up to `wait_s`), so its upload is
        the only one; the lock beside the output makes the check and the upload one step among regraft runs."""
        from filelock import FileLock

        deadline = time.monotonic() + wait_s
        while True:
            with FileLock(str(out.with_name(out.name + ".mlflow.lock"))):
                holder = self.holder(stage, key)
                if holder is not None:
                    return holder
                if time.monotonic() > deadline or not self.others_pending(run_id, stage, key):
                    self.log_files(run_id, out)
                    self.set_tags(run_id, {"artifacts_run": run_id, "artifacts": "uploaded"})
                    return None
            time.sleep(0.5)

    @staticmethod
    def original_seconds(holder: Any, out: Path) -> tuple[float | None, str]:
        """A hit's `stage_seconds`: those of the run that computed it, else the manifest's span; and which."""
        if holder is not None and holder.data.tags.get("cache_hit") == "false" and \
                "stage_seconds" in holder.data.metrics:
            return holder.data.metrics["stage_seconds"], f"cache hit: the seconds of run {holder.info.run_id}, " \
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


class Tracker:
    """The parent run of one invocation and a child run per stage node (start_stage, finish_stage), in one store.

    Nothing here waits on the store: each call queues a record that the store's outbox (pipelines/outbox.py) sends
    from its own thread, so a store that is slow or gone never holds up a stage. What it could not send is kept in
    the outbox folder and sent by the next regraft command; `finish` waits for this tracker's records and says so.
    """

    def __init__(self, cfg: DictConfig, run: Invocation | str, tags: dict[str, str]):
        from pipelines.outbox import Outbox, owner_tags

        self.cfg = cfg
        self.invocation = run if isinstance(run, Invocation) else Invocation(run)
        self.outbox = Outbox.of(cfg)  # opens the store (creating or migrating it) unless it does not answer
        self.owner = owner_tags()
        self.letter = self.outbox.letter(self.owner)
        self.commit = git_commit()
        self.stages: dict[str, tuple[Node, str]] = {}  # child handle -> its node and cache key
        self.parent = self.handle()
        self.queue("create_run", handle=self.parent, name=self.invocation.name,
                   tags={**tags, **self.invocation.tags, **self.owner, "git_commit": self.commit, "kind": "pipeline"})

    def handle(self) -> str:
        return self.outbox.new_handle()

    def queue(self, op: str, **args: Any) -> None:
        self.outbox.put(self.letter, {"op": op, "at": int(time.time() * 1000), "args": args})

    def start_stage(self, node: Node, key: str, config: DictConfig, hit: bool) -> str:
        """A child run for a node; `cache_hit` is `pending` while a dispatched job may still find it complete.
        Returns the run's handle, which finish_stage takes."""
        tags = {**self.invocation.tags, **self.owner, "stage": node.stage, "node": node.name, "phase": node.phase,
                "cache_key": key, "cache_hit": "true" if hit else "pending", "git_commit": self.commit}
        name = node.name if self.invocation.name == "defaults" else f"{node.name} · {self.invocation.name}"
        handle = self.handle()
        self.stages[handle] = (node, key)
        self.queue("create_run", handle=handle, name=name, tags=tags, parent=self.parent,
                   params=OmegaConf.to_container(config, resolve=True, enum_to_str=True))
        return handle

    def finish_stage(self, handle: str, outcome: StageOutcome | None, error: str | None = None,
                     job_id: str = "", log: str = "", status: str = "FAILED", versions_note: str = "") -> None:
        """A stage's results into its child run; without an outcome, `error` and `status` (FAILED or KILLED)."""
        tags = {"job_id": job_id, "versions_differ": versions_note, "job_log": log}
        node, key = self.stages.get(handle, (None, ""))
        self.queue("finish_stage", handle=handle, stage=node.stage if node else "", key=key,
                   outcome=None if outcome is None else {"out": str(outcome.out), "hit": outcome.hit,
                                                         "metrics": plain_numbers(outcome.metrics),
                                                         "seconds": outcome.seconds},
                   error=error, tags={key: value for key, value in tags.items() if value}, status=status)

    @classmethod
    def for_pipeline(cls, cfg: DictConfig, run: Invocation, overrides: list[str], run_dir: Path) -> "Tracker | None":
        """A pipeline run's parent run, tagged with its overrides and run folder; None when tracking is off."""
        if not cfg.enabled:
            return None
        return cls(cfg, run, tags={"overrides": " ".join(overrides) or "(defaults)", "run_dir": str(run_dir)})

    def finish_pipeline(self, status: str, overrides: list[str], summary: dict, files: list[Path]) -> None:
        """The parent run closed from the run's summary, its overrides as params."""
        params = {override_key(override): override_value(override) for override in overrides if "=" in override}
        self.finish(status, params, summary["numbers"], files, summary)

    def finish(self, status: str, params: dict[str, Any], metrics: dict[str, float], files: list[Path],
               summary: dict | None = None) -> None:
        """The parent run: its overrides as params, the headline numbers (`phase1/accept_len`, ...) and, given the
        run's summary, how many stages ran and were hits, which nodes were one computation, and a note. Then waits
        for this tracker's records to be sent or kept."""
        tags: dict[str, str] = {}
        metrics = {key: float(value) for key, value in metrics.items() if numeric(value)}
        same_computation: dict[str, str] = {}
        if summary is not None:
            stages = summary["stages"]
            ran = sorted(name for name, stage in stages.items() if not stage["hit"])
            metrics.update({"stages/ran": len(ran), "stages/hit": len(stages) - len(ran)})
            tags["stages_ran"] = " ".join(ran) or "(none: every stage was a cache hit)"
            for group in summary.get("one_computation", []):
                for handle, (node, _) in self.stages.items():
                    if node.name in group:
                        same_computation[handle] = " ".join(name for name in group if name != node.name)
            if summary.get("phase1_is_scratch"):
                tags["phase1_is_scratch"] = "true"
            tags["mlflow.note.content"] = run_note(summary)
        self.queue("finish_parent", handle=self.parent, status=status, params=params, metrics=metrics, tags=tags,
                   files=[str(path) for path in files], same_computation=same_computation)
        self.outbox.close(self.letter)

    def run_id(self, handle: str) -> str | None:
        """The store's id for a handle, once the store has it."""
        return self.letter.ids.get(handle)

    @property
    def parent_id(self) -> str | None:
        return self.run_id(self.parent)

    def ui_command(self) -> str:
        return ui_command(self.cfg)

    def runs_link(self) -> str | None:
        """The runs table on every pipeline's parent run, this one's sweep only if it is a sweep member; None while
        the store does not answer."""
        if not self.outbox.answering():
            return None
        sweep = self.invocation.tags.get("sweep")
        return runs_link(self.outbox.client, self.outbox.experiment_id, self.cfg, sweep)


def plain_numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    """A stage's figures as JSON keeps them (a record may wait in an outbox file)."""
    return {key: float(value) if numeric(value) else str(value) for key, value in metrics.items()}


def ui_command(cfg: DictConfig) -> str:
    return f"mlflow ui --backend-store-uri {cfg.uri}"


# The runs table's columns for "which member won": the accept lengths beside the run's name and overrides
WINNER_COLUMNS = ("phase1/accept_len", "phase0/accept_len", "scratch/accept_len", "gain/over_scratch")
SHARED_VIEW_TAG = "mlflow.sharedViewState."  # MLflow's UI reads a shared view (filter, sort, columns) from this tag
UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default


def runs_view(sweep: str | None) -> dict[str, Any]:
    """What MLflow's runs table opens on: the parent runs (of one sweep), best phase 1 first, the headline columns."""
    where = "tags.kind = 'pipeline'" + (f" and tags.sweep = '{sweep}'" if sweep else "")
    return {"searchFilter": where, "orderByKey": "metrics.`phase1/accept_len`", "orderByAsc": False,
            "startTime": "ALL", "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs",
            "selectedColumns": ["attributes.`Run Name`", *(f"metrics.`{name}`" for name in WINNER_COLUMNS)],
            "runsExpanded": {}, "runsPinned": [], "runsHidden": []}


def runs_link(client: Any, experiment_id: str, cfg: DictConfig, sweep: str | None) -> str:
    """One link to the runs table filtered, sorted and with columns set: the view is kept as an experiment tag that
    the UI reads by its key (MLflow's own "share view"), as filter and sort alone could be in the URL but the
    columns cannot."""
    key = "regraft-" + hashlib.sha256((sweep or "all").encode()).hexdigest()[:12]
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG + key, json.dumps(runs_view(sweep)))
    base = cfg.uri.rstrip("/") if cfg.uri.startswith(("http://", "https://")) else UI_ADDRESS
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={key}"


def sweep_link(cfg: DictConfig, sweep: str) -> str | None:
    """The link for a finished sweep, from its config (the sweep callback has no tracker)."""
    if not cfg.enabled:
        return None
    from mlflow.tracking import MlflowClient

    from pipelines.outbox import quick_http

    quick_http(cfg)
    client = MlflowClient(cfg.uri)
    try:
        experiment = client.get_experiment_by_name(cfg.experiment)
        return runs_link(client, experiment.experiment_id, cfg, sweep) if experiment else None
    except Exception:  # noqa: BLE001 (a store that does not answer: its members said so, the link can wait)
        return None


def run_note(summary: dict) -> str:
    """The parent run's description: the headline, what ran, and what was one computation."""
    numbers = summary.get("numbers", {})
    figures = ", ".join(f"{label} {numbers[key]:.3f}" for key, label in
                        (("phase0/accept_len", "phase 0"), ("phase1/accept_len", "phase 1"),
                         ("scratch/accept_len", "scratch")) if numeric(numbers.get(key)))
    stages = summary.get("stages", {})
    ran = sum(1 for stage in stages.values() if not stage["hit"])
    lines = [f"accept_len: {figures or 'not measured'}", f"{ran} of {len(stages)} stages ran, "
             f"{len(stages) - ran} were cache hits"]
    if summary.get("phase1_is_scratch"):
        lines.append("finetune.init=scratch: the fine-tune is the from-scratch baseline (one cache key), so phase 1 "
                     "is the scratch result and no separate scratch figure is logged")
    return "\n\n".join(lines)
