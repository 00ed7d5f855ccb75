"""A sweep is one DAG (pipelines/sweep.py, hydra_plugins/regraft_launcher): the same numbers, hits and MLflow runs
as the sweep run member by member (Hydra's basic launcher), each shared stage run once, and a failing member
leaves the others to finish and says why in one line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bad_inputs import mlflow_runs

ROOT = Path(__file__).resolve().parents[1]
TINY = ["debug=tiny", "pipeline.probe=false", "finetune.max_steps=6"]


def sweep(outputs: Path, *overrides: str, tiny: list[str] = TINY) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipelines.regraft", "-m", f"paths.outputs={outputs}",
               f"hydra.sweep.dir={outputs}/sweep", *tiny, *overrides]
    return subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)


def members(outputs: Path) -> list[dict]:
    paths = sorted((outputs / "sweep").glob("*/summary.json"), key=lambda path: int(path.parent.name))
    return [json.loads(path.read_text()) for path in paths]


def parents(outputs: Path) -> dict[str, dict[str, float]]:
    """Each member's parent run: its metrics, by member number."""
    return {run.data.tags["member"]: run.data.metrics for run in mlflow_runs(outputs)
            if "mlflow.parentRunId" not in run.data.tags}


def swept(overrides: list[str]) -> list[str]:
    return [override for override in overrides if not override.startswith(("paths.", "hydra."))]


def untimed(numbers: dict) -> dict:
    return {key: value for key, value in numbers.items() if "seconds" not in key and "tok_s" not in key}


@pytest.mark.long  # tests/test_slurm_pipeline.py holds the same comparison on Slurm in the default run
def test_one_dag_equals_the_sweep_member_by_member(tmp_path):
    grid = ["finetune.lr=1e-3,3e-3"]
    one = sweep(tmp_path / "one", *grid)
    assert one.returncode == 0, one.stdout[-3000:]
    basic = sweep(tmp_path / "basic", *grid, "hydra/launcher=basic")
    assert basic.returncode == 0, basic.stdout[-3000:]
    ours, theirs = members(tmp_path / "one"), members(tmp_path / "basic")
    assert len(ours) == 2
    for a, b in zip(ours, theirs, strict=True):
        assert swept(a["overrides"]) == swept(b["overrides"])
        assert untimed(a["numbers"]) == pytest.approx(untimed(b["numbers"]), rel=1e-6)
        assert {name: stage["hit"] for name, stage in a["stages"].items()} == \
            {name: stage["hit"] for name, stage in b["stages"].items()}  # later members find shared stages done
    ran = [(stage["stage"], stage["key"]) for member in ours for stage in member["stages"].values()
           if not stage["hit"]]
    assert len(ran) == len(set(ran))  # every stage output computed once across the whole sweep
    ours_runs, theirs_runs = parents(tmp_path / "one"), parents(tmp_path / "basic")
    assert ours_runs.keys() == theirs_runs.keys() == {"0", "1"}
    for member, metrics in ours_runs.items():
        assert untimed(metrics) == pytest.approx(untimed(theirs_runs[member]), rel=1e-6)


@pytest.mark.slow
def test_a_failing_member_leaves_the_others_to_finish(tmp_path):
    from tests.conftest import write_chats

    # member 1 counts its chats cut to 4 tokens, before any assistant turn: its vocab_map fails in its job
    done = sweep(tmp_path, "vocab_map.max_length=null,4")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 1, lines[-8:]
    good, bad = members(tmp_path)
    assert "failed" not in good and good["numbers"]["phase1/accept_len"] >= 1.0
    assert bad["failed"].startswith("vocab_map: ") and "no assistant tokens" in bad["failed"]
    said = [line for line in lines if line.startswith("member 1 ")]
    assert len(said) == 1 and "failed at vocab_map: " in said[0], lines[-8:]
    status = {run.data.tags["member"]: run.info.status for run in mlflow_runs(tmp_path)
              if "mlflow.parentRunId" not in run.data.tags}
    assert status == {"0": "FINISHED", "1": "FAILED"}


def test_members_on_two_launchers_are_refused_before_any_work(tmp_path):
    done = sweep(tmp_path, "launcher=local,inline")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 1, lines[-5:]
    assert lines[-1].startswith("error: launcher: differs between sweep members 0 and 1") and "(fix: " in lines[-1]
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_every_child_run_holds_its_own_output_beside_a_second_run(tmp_path):
    """A 4-member sweep and a single run started beside it on one outputs folder: every child run that names a
    cache output holds that output's figures, and nothing is left RUNNING or `pending` (tests/mlflow_checks.py)."""
    from tests.mlflow_checks import check_store

    tiny = [override for override in TINY if override != "pipeline.probe=false"]  # phase 0 too: the link shows it
    single = [sys.executable, "-m", "pipelines.regraft", f"paths.outputs={tmp_path}",
              f"hydra.run.dir={tmp_path}/single", *tiny, "finetune.lr=1e-3"]
    beside = subprocess.Popen(single, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        done = sweep(tmp_path, "finetune.lr=1e-3,3e-3", "finetune.init=remap,scratch", tiny=tiny)
        output, _ = beside.communicate(timeout=900)
    finally:
        if beside.poll() is None:
            beside.kill()
    assert done.returncode == 0, done.stdout[-3000:]
    assert beside.returncode == 0, output[-3000:]
    assert len(members(tmp_path)) == 4
    for member in range(4):  # each member's log is regraft.log and holds its tables
        folder = tmp_path / "sweep" / str(member)
        assert "regraft: stages" in (folder / "regraft.log").read_text() and not (folder / "app.log").exists()
    parents_seen = [run for run in mlflow_runs(tmp_path) if "mlflow.parentRunId" not in run.data.tags]
    assert len(parents_seen) == 5
    assert check_store(f"sqlite:///{tmp_path}/mlflow.db") >= 5 * 8  # every member's children, and the single run's
    assert_link_opens_on_the_winner(tmp_path, done.stdout)


def assert_link_opens_on_the_winner(outputs: Path, printed: str) -> None:
    """The sweep's printed link, opened in headless Chromium on a real `mlflow ui`: its first row is the member with
    the best phase1/accept_len, and the headline columns are shown."""
    from tests.mlflow_checks import first_row_run_id, rendered_runs_table

    lines = printed.splitlines()
    assert f"MLflow: mlflow ui --port 5000 --backend-store-uri sqlite:///{outputs}/mlflow.db" in lines
    link = next(line.split(": ", 1)[1] for line in lines if line.startswith("which member won: "))
    best = max(member["numbers"]["phase1/accept_len"] for member in members(outputs))
    winners = {run.info.run_id for run in mlflow_runs(outputs) if "mlflow.parentRunId" not in run.data.tags
               and run.data.tags.get("sweep") == "sweep" and run.data.metrics["phase1/accept_len"] == best}
    dom = rendered_runs_table(f"sqlite:///{outputs}/mlflow.db", link, outputs / "chromium")
    assert first_row_run_id(dom) in winners, dom[-2000:]
    for column in ("phase1/accept_len", "phase0/accept_len", "scratch/accept_len"):
        assert f'col-id="metrics.`{column}`"' in dom
    assert len(set(re.findall(r'row-id="([0-9a-f]{32})"', dom))) == 4  # the sweep's four parents, not the single run
