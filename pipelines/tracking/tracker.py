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
  `scratch/accept_len`, `phase1/val_acc_0`, `phase0/loss_0` (the source lm_head as it is) ... (pipelines/report/summary.py
  `HEADLINES`: every name differs from the others in its first 12 characters, what MLflow's table shows), and
  `stages/ran`, `stages/hit`.
Runs are named by the overrides that vary in their sweep (`lr=1e-3 init=remap`), a single run by its overrides
(or `defaults`); the sweep's tags (`sweep`, `member`, each swept key) are on the parent and on every child.

A cache hit uploads no artifacts: its tag `artifacts_run` names the child run that holds them (the first upload of
this computation of the stage's output in this store, whichever run made it); its `stage_seconds` is the original
run's, marked by the tag `stage_seconds_from`.
The sqlite store is created and migrated once, under a file lock beside it, so runs started together share it.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipelines.core.dag import Node
from pipelines.core.jobs import StageOutcome
from pipelines.tracking.links import UI_PORT
from pipelines.tracking.outbox import owner_tags
from pipelines.tracking.run_names import Invocation, override_key, override_value
from pipelines.tracking.store import numeric
from pipelines.tracking.store_agent import outbox_for

# conf/config.yaml names run and sweep folders by time, microseconds and this process's id (`${regraft.pid:}`):
# two invocations started in the same second never share a folder
OmegaConf.register_new_resolver("regraft.pid", os.getpid, replace=True)

ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


class Tracker:
    """The parent run of one invocation and a child run per stage node (start_stage, finish_stage), in one store.

    Nothing here waits on the store: each call queues a record that the store's outbox (pipelines/tracking/outbox.py) sends
    from its own thread, so a store that is slow or gone never holds up a stage. What it could not send is kept in
    the outbox folder and sent by the next regraft command; `finish` waits for this tracker's records and says so.
    """

    def __init__(self, cfg: DictConfig, run: Invocation | str, tags: dict[str, str]):
        self.cfg = cfg
        self.invocation = run if isinstance(run, Invocation) else Invocation(run)
        self.outbox = outbox_for(cfg)  # opens the store (creating or migrating it) unless it does not answer
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
        return self.outbox.runs_link(self.invocation.tags.get("sweep"))


def plain_numbers(metrics: dict[str, Any]) -> dict[str, Any]:
    """A stage's figures as JSON keeps them (a record may wait in an outbox file)."""
    return {key: float(value) if numeric(value) else str(value) for key, value in metrics.items()}


def ui_command(cfg: DictConfig) -> str:
    """How to open the MLflow UI on the store: an http(s) store's server is its own UI (`mlflow ui` takes no server
    as its store); any other store is opened with `mlflow ui`."""
    if str(cfg.uri).startswith(("http://", "https://")):
        return f"{cfg.uri} (the tracking server's own UI)"
    return f"mlflow ui --port {UI_PORT} --backend-store-uri {cfg.uri}"  # the port the printed links name


def sweep_link(cfg: DictConfig, sweep: str) -> str | None:
    """The link for a finished sweep, from its config (the sweep callback has no tracker)."""
    if not cfg.enabled:
        return None
    try:
        return outbox_for(cfg).runs_link(sweep)
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
