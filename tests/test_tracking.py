"""MLflow tracking against real stores: a sqlite file (created by runs started together, half-migrated, broken) and
a real `mlflow server` over http. The Tracker is driven directly with stage outputs written here (a fine-tune's
metrics.jsonl and a probe's per-turn table); one end-to-end test runs four regraft invocations at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipelines.core.dag import Node
from pipelines.core.jobs import StageOutcome
from pipelines.core.progress import StageProgress, last_line
from pipelines.tracking.outbox import Outbox
from pipelines.tracking.run_names import invocation, swept_keys
from pipelines.tracking.tracker import Tracker
from stages.common.contract.errors import RegraftError
from tests.mlflow_checks import free_port, start_mlflow_server, stop_mlflow_server

ROOT = Path(__file__).resolve().parents[1]


def tracking_cfg(uri: str, outputs: Path):
    return OmegaConf.create({"enabled": True, "uri": uri, "experiment": "regraft",
                             "artifact_location": str(outputs / "mlartifacts"), "copy_checkpoints": False,
                             "max_artifact_mb": 20.0})


def client_of(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def manifest(out: Path, metrics: dict, seconds: float = 3.0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    (out / "manifest.json").write_text(json.dumps({"stage": out.parent.name, "started_at": 1000.0,
                                                   "finished_at": 1000.0 + seconds, "metrics": metrics,
                                                   "headline": "", "files": files, "complete": True}))


def finetune_output(out: Path) -> StageOutcome:
    """A fine-tune's output as the stage leaves it: the guard's line, 2 train steps, 1 validation."""
    (out / "drafter").mkdir(parents=True)
    (out / "drafter" / "model.safetensors").write_bytes(b"\0" * 4096)  # a checkpoint: hashed, not copied
    (out / "drafter" / "config.json").write_text("{}")
    lines = [{"step": 0, "split": "preflight", "preflight_loss_0": 2.5, "preflight_full_acc_0": 0.4,
              "preflight_as_is_loss_0": 9.0},
             {"step": 1, "split": "train", "loss": 3.0, "full_acc_0": 0.2, "lr": 0.001},
             {"step": 2, "split": "train", "loss": 2.0, "full_acc_0": 0.3, "lr": 0.001},
             {"step": 2, "split": "val", "loss": 2.2, "full_acc_0": 0.35}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    metrics = {"preflight_loss_0": 2.5, "preflight_full_acc_0": 0.4, "preflight_as_is_loss_0": 9.0,
               "val_loss": 2.2, "val_full_acc_0": 0.35}
    manifest(out, metrics)
    return StageOutcome(str(out), False, metrics, "init=remap", 12.5)


def probe_output(out: Path) -> StageOutcome:
    out.mkdir(parents=True)
    (out / "per_prompt.csv").write_text("turn,accept_len,completion_tokens\n0,1.5,10\n1,2.5,12\n")
    (out / "report.json").write_text("{}")
    metrics = {"accept_len": 2.0, "completion_tokens": 22, "tok_s": 40.0}
    manifest(out, metrics, seconds=4.0)
    return StageOutcome(str(out), False, metrics, "accept_len 2.00", 4.5)


def hit(outcome: StageOutcome) -> StageOutcome:
    return StageOutcome(outcome.out, True, outcome.metrics, outcome.headline, 0.0)


def summary_of(stages: dict[str, tuple[str, str, bool]], numbers: dict) -> dict:
    return {"numbers": numbers, "stages": {name: {"stage": stage, "key": key, "hit": was_hit}
                                           for name, (stage, key, was_hit) in stages.items()},
            "one_computation": [], "phase1_is_scratch": False}


def track(cfg, run, outputs: dict[str, tuple[Node, str, StageOutcome]], numbers: dict) -> Tracker:
    tracker = Tracker(cfg, run, tags={"overrides": "x", "run_dir": "r"})
    for node, key, outcome in outputs.values():
        run_id = tracker.start_stage(node, key, OmegaConf.create({"lr": 0.001, "out": outcome.out}), outcome.hit)
        tracker.finish_stage(run_id, outcome, job_id="42")
    stages = {name: (node.stage, key, outcome.hit) for name, (node, key, outcome) in outputs.items()}
    tracker.finish("FINISHED", {"finetune.lr": "1e-3"}, numbers, [], summary_of(stages, numbers))
    return tracker


def artifact_files(client, run_id: str, path: str | None = None) -> list[str]:
    files = []
    for item in client.list_artifacts(run_id, path):
        files += artifact_files(client, run_id, item.path) if item.is_dir else [item.path]
    return files


def nodes_and_outputs(tmp_path: Path) -> dict:
    finetune = finetune_output(tmp_path / "cache" / "finetune" / "aaaa")
    probe = probe_output(tmp_path / "cache" / "probe" / "bbbb")
    return {"finetune": (Node("finetune", "finetune", OmegaConf.create({}), "1"), "aaaa", finetune),
            "evaluate": (Node("evaluate", "probe", OmegaConf.create({}), "1"), "bbbb", probe)}


def test_metric_names_tags_and_no_second_upload_on_a_cache_hit(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg, client = tracking_cfg(uri, tmp_path), client_of(uri)
    first = nodes_and_outputs(tmp_path)
    sweep = invocation(["finetune.lr=1e-3", "finetune.init=remap", "debug=tiny"], ["finetune.lr", "finetune.init"],
                       "2026-01-01_00-00-00_1_2", 0)
    numbers = {"phase1/accept_len": 2.0, "phase0/accept_len": 1.25}
    one = track(cfg, sweep, first, numbers)
    again = {name: (node, key, hit(outcome)) for name, (node, key, outcome) in first.items()}
    two = track(cfg, invocation(["finetune.lr=1e-3", "finetune.init=remap"], ["finetune.lr", "finetune.init"],
                                "2026-01-01_00-00-00_1_2", 1), again, numbers)

    experiment = client.get_experiment_by_name("regraft")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "phase1/accept_len" in experiment.tags["mlflow.note.content"]

    parent = client.get_run(one.parent_id)
    assert parent.info.run_name == "lr=1e-3 init=remap" and parent.info.status == "FINISHED"
    assert {key: parent.data.tags[key] for key in ("sweep", "member", "swept", "finetune.lr", "finetune.init")} == {
        "sweep": "2026-01-01_00-00-00_1_2", "member": "0", "swept": "finetune.lr finetune.init",
        "finetune.lr": "1e-3", "finetune.init": "remap"}
    assert parent.data.metrics == {"phase1/accept_len": 2.0, "phase0/accept_len": 1.25, "stages/ran": 2,
                                   "stages/hit": 0}
    assert client.get_run(two.parent_id).data.metrics["stages/hit"] == 2
    assert "2 of 2 stages ran" in parent.data.tags["mlflow.note.content"]

    children = {}
    for tracker in (one, two):
        for handle, (node, _) in tracker.stages.items():
            children[(tracker is two, node.name)] = client.get_run(tracker.run_id(handle))
    finetune, evaluate = children[(False, "finetune")], children[(False, "evaluate")]
    assert finetune.info.run_name == "finetune · lr=1e-3 init=remap"
    assert finetune.data.tags["sweep"] == "2026-01-01_00-00-00_1_2" and finetune.data.tags["finetune.lr"] == "1e-3"
    # one name per figure: the series' points, never `val.loss` beside `val_loss`
    assert set(finetune.data.metrics) == {"preflight/loss_0", "preflight/full_acc_0", "preflight/as_is_loss_0",
                                          "train/loss", "train/full_acc_0", "train/lr", "val/loss", "val/full_acc_0",
                                          "stage_seconds"}
    assert finetune.data.metrics["val/full_acc_0"] == 0.35 and finetune.data.metrics["stage_seconds"] == 12.5
    assert [m.step for m in client.get_metric_history(finetune.info.run_id, "train/loss")] == [1, 2]
    assert set(evaluate.data.metrics) == {"accept_len", "completion_tokens", "tok_s", "turn/accept_len",
                                          "turn/completion_tokens", "stage_seconds"}
    assert evaluate.data.metrics["accept_len"] == 2.0  # the stage's figure, not the last turn's (2.5)
    assert [m.value for m in client.get_metric_history(evaluate.info.run_id, "turn/accept_len")] == [1.5, 2.5]
    assert finetune.data.tags["sha256.drafter/model.safetensors"] and finetune.data.tags["cache_hit"] == "false"
    assert finetune.data.tags["artifacts"] == "uploaded" and finetune.data.tags["artifacts_run"] == finetune.info.run_id

    # the hits: the same figures, no artifacts of their own, a pointer to the run that holds them, original seconds
    assert sorted(artifact_files(client, finetune.info.run_id)) == [
        "drafter/config.json", "manifest.json", "metrics.jsonl"]  # the checkpoint is recorded, not copied
    for name, original in (("finetune", finetune), ("evaluate", evaluate)):
        cached = children[(True, name)]
        assert cached.data.tags["cache_hit"] == "true" and artifact_files(client, cached.info.run_id) == []
        assert cached.data.tags["artifacts_run"] == original.info.run_id
        assert cached.data.metrics == original.data.metrics  # stage_seconds included: the original run's
        assert original.info.run_id in cached.data.tags["stage_seconds_from"]
    artifacts = [p for p in (tmp_path / "mlartifacts").rglob("*") if p.is_file()]
    assert len(artifacts) == 3 + 3  # finetune's 3 and evaluate's 3 (csv, report, manifest), once


def test_a_hit_in_a_new_store_uploads_once_and_a_scratch_member_says_phase1_is_scratch(tmp_path):
    """A store that never saw the output (a new tracking.uri): the first hit uploads, later hits point at it."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg, client = tracking_cfg(uri, tmp_path), client_of(uri)
    outputs = {name: (node, key, hit(outcome)) for name, (node, key, outcome) in nodes_and_outputs(tmp_path).items()}
    first = track(cfg, invocation([]), outputs, {})
    second = track(cfg, invocation([]), outputs, {})
    assert client.get_run(first.parent_id).info.run_name == "defaults"
    holders = {node.name: first.run_id(handle) for handle, (node, _) in first.stages.items()}
    for handle, (node, _) in second.stages.items():
        run_id = second.run_id(handle)
        run = client.get_run(run_id)
        assert run.info.run_name == node.name and run.data.tags["artifacts_run"] == holders[node.name]
        assert artifact_files(client, run_id) == []
        assert "manifest" in run.data.tags["stage_seconds_from"]  # nobody measured it here: the manifest's span
    assert client.get_run(holders["evaluate"]).data.metrics["stage_seconds"] == 4.0

    tracker = Tracker(cfg, invocation(["finetune.init=scratch"]), tags={})
    finetune = finetune_output(tmp_path / "cache" / "finetune" / "cccc")
    ids = {}
    for name in ("finetune", "baseline_finetune"):
        ids[name] = tracker.start_stage(Node(name, "finetune", OmegaConf.create({}), "1"), "cccc", OmegaConf.create({}),
                                        False)
        tracker.finish_stage(ids[name], finetune if name == "finetune" else hit(finetune))
    summary = summary_of({"finetune": ("finetune", "cccc", False), "baseline_finetune": ("finetune", "cccc", True)},
                         {"phase1/accept_len": 1.5})
    summary.update(one_computation=[["finetune", "baseline_finetune"]], phase1_is_scratch=True)
    tracker.finish("FINISHED", {}, summary["numbers"], [], summary)
    parent = client.get_run(tracker.parent_id)
    assert parent.info.run_name == "init=scratch" and parent.data.tags["phase1_is_scratch"] == "true"
    assert "phase 1 is the scratch result" in parent.data.tags["mlflow.note.content"]
    baseline = client.get_run(tracker.run_id(ids["baseline_finetune"]))
    assert baseline.data.tags["same_computation_as"] == "finetune"
    assert baseline.data.tags["artifacts_run"] == tracker.run_id(ids["finetune"])


def test_run_names_from_overrides_and_sweeps():
    assert invocation([]).name == "defaults" and invocation([]).tags == {}
    assert invocation(["paths.outputs=/x", "debug=tiny", "remap.fallback=mean"]).name == "debug=tiny fallback=mean"
    member = invocation(["paths.outputs=/x", "finetune.lr=0.001", "finetune.init=scratch", "debug=tiny"],
                        swept_keys(["paths.outputs=/x", "finetune.lr=1e-3,3e-3", "finetune.init=remap,scratch",
                                    "debug=tiny"]), "sweepdir", 3)
    assert member.name == "lr=0.001 init=scratch"
    assert member.tags == {"sweep": "sweepdir", "member": "3", "swept": "finetune.lr finetune.init",
                           "finetune.lr": "0.001", "finetune.init": "scratch"}
    clash = invocation(["finetune.lr=1", "source.build.finetune.lr=2"], ["finetune.lr", "source.build.finetune.lr"], "s", 0)
    assert clash.name == "finetune.lr=1 source.build.finetune.lr=2"  # short names only where they stay unambiguous
    assert swept_keys(["a=1"], {"finetune.seed": "range(0,3)"}) == ["finetune.seed"]


def test_single_runs_of_the_same_overrides_are_told_apart_by_when_they_started():
    from pipelines.tracking.run_names import started

    when = started("/out/runs/2026-12-07_11-24-38_331207_14875")
    assert when == "12-07 11:24:38" and started("/out/elsewhere") is None and started(None) is None
    assert invocation([], when=when).name == "defaults · 12-07 11:24:38"
    assert invocation(["paths.outputs=/x", "debug=tiny"], when=when).name == "debug=tiny · 12-07 11:24:38"
    member = invocation(["finetune.lr=0.001"], ["finetune.lr"], "sweepdir", 0, when=when)
    assert member.name == "lr=0.001"  # a member is its values; its sweep is a tag


def test_the_winner_view_shows_its_columns_whole():
    """MLflow gives a metric column 100 px (`phase1/accep`); the shared view sets the link's columns' widths and
    order (tests/test_ui.py sees them rendered)."""
    from pipelines.tracking.links import WINNER_COLUMNS, runs_view

    view = runs_view("s")
    columns = [f"metrics.`{name}`" for name in WINNER_COLUMNS]
    assert view["columnOrder"] == ["attributes.`Run Name`", *columns] == view["selectedColumns"]
    assert all(view["columnWidths"][column] >= 9 * len(name) + 24 for column, name in zip(columns, WINNER_COLUMNS))


def test_a_half_created_store_is_repaired(tmp_path):
    import sqlalchemy
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/mlflow.db")
    InitialBase.metadata.create_all(engine)  # what a run killed before its first migration leaves
    engine.dispose()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(tracking_cfg(uri, tmp_path), invocation([]), tags={})
    tracker.finish("FINISHED", {}, {"phase1/accept_len": 1.0}, [])
    assert client_of(uri).get_run(tracker.parent_id).data.metrics == {"phase1/accept_len": 1.0}


def test_a_store_that_cannot_be_migrated_is_named_in_one_line(tmp_path):
    import sqlalchemy

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    Tracker(tracking_cfg(uri, tmp_path), invocation([]), tags={})
    engine = sqlalchemy.create_engine(uri)
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text("UPDATE alembic_version SET version_num = 'deadbeef0000'"))
    engine.dispose()
    Outbox.opened.clear()  # a process opens a store once; this is the next command's first look at it
    with pytest.raises(RegraftError) as error:
        Tracker(tracking_cfg(uri, tmp_path), invocation([]), tags={})
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "mlflow.db") in message
    assert "deadbeef0000" in message and f"mv {tmp_path / 'mlflow.db'}" in message


STARTED_TOGETHER = """
import sys, time
from pathlib import Path
from omegaconf import OmegaConf
import mlflow.store.tracking.sqlalchemy_store  # imported before the start: the four open the store at one instant
from pipelines.tracking.run_names import invocation
from pipelines.tracking.tracker import Tracker
cfg = OmegaConf.create({"uri": sys.argv[1], "experiment": "regraft", "artifact_location": sys.argv[2],
                        "copy_checkpoints": False, "max_artifact_mb": 20.0})
print("ready", flush=True)
while not Path(sys.argv[3]).exists():
    time.sleep(0.002)
tracker = Tracker(cfg, invocation([f"finetune.seed={sys.argv[4]}"]), tags={})
tracker.finish("FINISHED", {}, {"phase1/accept_len": 1.0}, [])
"""


def test_runs_started_together_create_the_store_once(tmp_path):
    """Four processes open one new sqlite store at the same instant (without the lock, alembic errors)."""
    uri = f"sqlite:///{tmp_path}/outputs/mlflow.db"
    go = tmp_path / "go"
    processes = [subprocess.Popen([sys.executable, "-c", STARTED_TOGETHER, uri, str(tmp_path / "art"), str(go),
                                   str(seed)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for seed in range(4)]
    for process in processes:
        assert process.stdout.readline().strip() == "ready", process.communicate()[0]
    go.touch()
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert [process.returncode for process in processes] == [0] * 4, "\n".join(outputs)
    client = client_of(uri)
    runs = client.search_runs([client.get_experiment_by_name("regraft").experiment_id])
    assert sorted(run.info.run_name for run in runs) == [f"seed={seed}" for seed in range(4)]
    assert {run.info.status for run in runs} == {"FINISHED"}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    port = free_port()
    server = start_mlflow_server(folder, port)
    yield f"http://127.0.0.1:{port}", folder
    stop_mlflow_server(server)


def test_names_tags_and_hits_through_a_tracking_server(mlflow_server, tmp_path):
    uri, _ = mlflow_server
    cfg, client = tracking_cfg(uri, tmp_path), client_of(uri)
    outputs = nodes_and_outputs(tmp_path)
    member = invocation(["finetune.lr=0.003", "finetune.init=remap"], ["finetune.lr", "finetune.init"], "sw", 1)
    first = track(cfg, member, outputs, {"phase1/accept_len": 2.0, "scratch/accept_len": 1.5})
    second = track(cfg, member, {n: (node, key, hit(o)) for n, (node, key, o) in outputs.items()}, {})
    experiment = client.get_experiment_by_name("regraft")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    parents = client.search_runs([experiment.experiment_id], "tags.kind = 'pipeline' and tags.sweep = 'sw'",
                                 order_by=["metrics.`phase1/accept_len` DESC"])
    assert [run.info.run_id for run in parents] == [first.parent_id, second.parent_id]
    assert parents[0].info.run_name == "lr=0.003 init=remap" and parents[0].data.tags["finetune.init"] == "remap"
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{second.parent_id}'")
    assert {run.data.tags["node"] for run in children} == {"finetune", "evaluate"}
    for run in children:
        assert run.data.tags["member"] == "1" and run.data.tags["finetune.lr"] == "0.003"
        assert run.data.tags["artifacts_run"] in {first.run_id(handle) for handle in first.stages}
        assert artifact_files(client, run.info.run_id) == []
    assert artifact_files(client, first.run_id(next(iter(first.stages))))


def track_and_die(cfg, finish: bool) -> None:
    """A regraft process's tracking in a process of its own: a parent and a child run, then its end, either closing
    its runs (`finish`) or leaving them to whoever looks next (as `kill -9` does)."""
    code = f"""
import os
from omegaconf import OmegaConf
from pipelines.core.dag import Node
from pipelines.tracking.tracker import Tracker
tracker = Tracker(OmegaConf.create({OmegaConf.to_container(cfg)!r}), "gone", tags={{}})
node = Node("world", "world", OmegaConf.create({{}}), "setup")
tracker.finish_stage(tracker.start_stage(node, "k", OmegaConf.create({{}}), False), None, "stopped")
if {finish!r}:
    tracker.finish("FAILED", {{}}, {{}}, [])
tracker.outbox.wait(tracker.letter)
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, timeout=300)


def replay_outbox(*arguments: str) -> tuple[int, list[str]]:
    done = subprocess.run([sys.executable, "-m", "pipelines.tracking.outbox", *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    return done.returncode, [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


def test_the_outbox_command_closes_what_a_gone_process_left_running_with_nothing_kept(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    track_and_die(tracking_cfg(uri, tmp_path), finish=False)
    client = client_of(uri)
    experiment = client.get_experiment_by_name("regraft").experiment_id
    statuses = {run.data.tags.get("node", "parent"): run.info.status for run in client.search_runs([experiment])}
    assert statuses == {"parent": "RUNNING", "world": "FAILED"}  # the stage ended, the process that ran it did not
    assert replay_outbox(str(tmp_path / "outbox")) == (0, [
        "tracking: closed 1 runs left RUNNING by regraft processes that are gone (status KILLED, tag closed_because)"])
    statuses = {run.data.tags.get("node", "parent"): run.info.status for run in client.search_runs([experiment])}
    assert statuses == {"parent": "KILLED", "world": "FAILED"}
    assert replay_outbox(str(tmp_path / "outbox")) == (0, [
        f"tracking: {uri}: nothing kept in {tmp_path / 'outbox'} to send, and no run left RUNNING by a regraft "
        "process that is gone"])
    # a store elsewhere, named
    elsewhere = f"sqlite:///{tmp_path}/elsewhere.db"
    track_and_die(tracking_cfg(elsewhere, tmp_path), finish=False)
    nothing = tmp_path / "other" / "outbox"  # no mlflow.db beside it
    assert replay_outbox(str(nothing), "--uri", elsewhere)[1] == [
        "tracking: closed 1 runs left RUNNING by regraft processes that are gone (status KILLED, tag closed_because)"]
    assert replay_outbox(str(nothing))[1] == [
        f"tracking: nothing kept in {nothing}, and no store beside it (mlflow.db) or given (--uri) to close runs in"]


def test_a_replay_to_a_server_says_one_line_and_an_outage_in_whole_words(tmp_path):
    """A letter kept while the server was down: the command says in whole words why it still cannot send it, then,
    with the server up, one line for all it sent (MLflow's own lines about each run it ends stay unsaid)."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    cfg = tracking_cfg(uri, tmp_path)
    cfg.timeout_s, cfg.retries = 2, 0
    track_and_die(cfg, finish=True)
    [letter] = (tmp_path / "outbox").glob("*.json")
    kept = len(json.loads(letter.read_text())["records"])
    status, lines = replay_outbox(str(tmp_path / "outbox"))
    assert status == 1 and lines == [
        f"tracking: {uri} still does not answer (MlflowException: API request to {uri}/api/2.0/mlflow/experiments/"
        "get-by-name failed with exception ConnectionRefusedError: [Errno 111] Connection refused); its letters stay "
        f"in {tmp_path / 'outbox'}"], lines
    server = start_mlflow_server(tmp_path / "server", port)
    try:
        status, lines = replay_outbox(str(tmp_path / "outbox"))
        assert status == 0 and lines == [
            f"tracking: sent {kept} updates that an outage had kept in {tmp_path / 'outbox'}"], lines
        assert not letter.exists()
        runs = client_of(uri).search_runs([client_of(uri).get_experiment_by_name("regraft").experiment_id])
        assert sorted(run.info.status for run in runs) == ["FAILED", "FAILED"]
    finally:
        stop_mlflow_server(server)


def test_the_ui_of_a_store_is_mlflow_ui_or_the_server_itself(tmp_path):
    from pipelines.tracking.tracker import ui_command

    assert ui_command(tracking_cfg("sqlite:///outputs/mlflow.db", tmp_path)) == \
        "mlflow ui --port 5000 --backend-store-uri sqlite:///outputs/mlflow.db"
    assert ui_command(tracking_cfg("http://mlflow:5000", tmp_path)) == "http://mlflow:5000 (the tracking server's own UI)"


def test_progress_shows_the_latest_tqdm_line(tmp_path):
    from rich.console import Console

    log = tmp_path / "123_0_log.err"
    log.write_text("loading\nfinetune:  25%|##5       | 1/4 [00:01<00:03]"
                   "\rfinetune:  50%|#####     | 2/4 [00:02<00:02]\r")
    assert last_line(log) == "finetune:  50%|#####     | 2/4 [00:02<00:02]"
    assert last_line(tmp_path / "absent") == ""
    console = Console(file=open(tmp_path / "out.txt", "w"), force_terminal=False, width=80)
    progress = StageProgress(console, quiet_every_s=0.0)
    progress.update({"finetune": (time.perf_counter() - 75, str(log))})
    progress.update({})
    console.file.close()
    text = (tmp_path / "out.txt").read_text()
    assert text.splitlines() == ["          finetune running 1m15s: finetune:  50%|#####     | 2/4 [00:02<00:02]"]


def test_tables_fit_80_columns(tmp_path, capsys):
    from rich.console import Console

    from pipelines.core.runner import NodeResult
    from pipelines.report.summary import SweepSummary, stage_table

    results = {name: NodeResult(name, "probe", "1", "k" + name, "/o", False, 12.0, 13.5, {}, "accept_len 1.80 at 3 "
                                "draft steps, 43 tok/s vs 113 plain (0.38x), lossless on 40 turns")
               for name in ("probe", "evaluate", "baseline_evaluate")}
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(stage_table(results))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines) and sum("accept_len 1.80" in line for line in lines) == 3

    from pipelines.report.summary import story_table

    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(story_table({"phase0/accept_len": 1.3, "phase0/accept_len/prose": 1.25,
                               "phase0/accept_len/code": 1.4, "phase1/accept_len": 1.8}))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    rows = [line.split() for line in lines if "accept_len" in line]
    assert [row[-1] for row in rows] == ["phase0/accept_len", "phase0/accept_len/prose", "phase0/accept_len/code",
                                         "phase1/accept_len"]  # each set under its aggregate
    assert rows[1][:3] == ["on", "prose", "1.250"]

    sweep = tmp_path / "sweep"
    fixed = [f"paths.outputs={tmp_path}", "debug=tiny", *(f"world.knob{k}=1" for k in range(10))]
    for member, (lr, init) in enumerate([("0.001", "remap"), ("0.001", "scratch")]):
        (sweep / str(member)).mkdir(parents=True)
        (sweep / str(member) / "summary.json").write_text(json.dumps({
            "overrides": [*fixed, f"finetune.lr={lr}", f"finetune.init={init}"], "phase1_is_scratch": init == "scratch",
            "numbers": {"phase0/accept_len": 1.3, "phase1/accept_len": 1.8,
                        **({"scratch/accept_len": 1.5} if init == "remap" else {})},
            "stages": {"finetune": {"hit": member == 1}}}))
    config = OmegaConf.create({"tracking": {"enabled": False}, "hydra": {
        "sweep": {"dir": str(sweep)}, "sweeper": {"params": None}, "overrides": {
            "task": [*fixed, "finetune.lr=1e-3", "finetune.init=remap,scratch"]}}})
    SweepSummary().on_multirun_end(config)
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines() if not line.startswith("sweep summary: "))
    assert "init" in out and "knob" not in out and "paths" not in out
    scratch_member_row = next(line for line in out.splitlines() if line.split()[:2] == ["1", "scratch"])
    assert scratch_member_row.split()[-3:-1] == ["=phase", "1"]  # its scratch column is its phase 1
    assert json.loads((sweep / "summary.json").read_text())["swept"] == ["finetune.init"]


@pytest.mark.slow
def test_four_runs_started_together_share_one_store_and_cache(tmp_path):
    """Four `regraft debug=tiny` on a new outputs folder at once: every stage computed once, four complete parent
    runs with all their children and metrics, four run folders and summaries."""
    outputs = tmp_path / "outputs"
    command = [sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", "debug=tiny"]
    runs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(4)]
    logs = [run.communicate(timeout=1800)[0] for run in runs]
    assert [run.returncode for run in runs] == [0] * 4, "\n\n".join(log[-3000:] for log in logs)

    folders = sorted((outputs / "runs").iterdir())
    assert len(folders) == 4
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in folders]
    nodes = list(summaries[0]["stages"])
    for name in nodes:  # computed by exactly one of the four, a hit in the other three
        assert sorted(summary["stages"][name]["hit"] for summary in summaries) == [False, True, True, True], name
    assert all(not (folder / "jobs" / "%j").exists() for folder in folders)

    client = client_of(f"sqlite:///{outputs}/mlflow.db")
    experiment = client.get_experiment_by_name("regraft")
    parents = client.search_runs([experiment.experiment_id], "tags.kind = 'pipeline'")
    assert len(parents) == 4 and {run.info.status for run in parents} == {"FINISHED"}
    assert sorted(run.data.tags["run_dir"] for run in parents) == [str(folder) for folder in folders]
    assert sorted(run.data.metrics["stages/ran"] for run in parents) == sorted(
        sum(not stage["hit"] for stage in summary["stages"].values()) for summary in summaries)
    holders = set()
    for parent in parents:
        assert parent.info.run_name.startswith("debug=tiny · ") and "phase1/accept_len" in parent.data.metrics
        children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(run.data.tags["node"] for run in children) == sorted(nodes)
        for run in children:
            assert run.info.status == "FINISHED" and "stage_seconds" in run.data.metrics, run.data.tags["node"]
            holders.add((run.data.tags["node"], run.data.tags["artifacts_run"]))
        evaluate = next(run for run in children if run.data.tags["node"] == "evaluate")
        assert parent.data.metrics["phase1/accept_len"] == evaluate.data.metrics["accept_len"]
    assert len(holders) == len(nodes)  # each stage's artifacts are held by one run, whichever of the four


def test_parent_figures_differ_in_the_first_12_characters_mlflow_shows():
    from pipelines.report.summary import LABELS

    names = [*LABELS, "stages/ran", "stages/hit"]
    heads = [name[:12] for name in names]
    assert len(set(heads)) == len(heads), sorted(heads)


def test_a_figure_has_one_name():
    """cond_acc_0 is full_acc_0 by definition, and is not logged twice."""
    import torch

    from stages.common.drafter.ttt import ttt_metrics

    metrics = ttt_metrics(torch.tensor([1.0, 2.0]), torch.tensor([3, 1]), torch.tensor([4, 4]), torch.tensor([3, 1]),
                          torch.tensor([4, 3]))
    assert "cond_acc_0" not in metrics and metrics["full_acc_0"] == 0.75 and metrics["cond_acc_1"] == pytest.approx(1 / 3)


def test_the_printed_links_open_the_classic_view_with_the_headline_columns_whole(tmp_path):
    """Headless Chromium on a real `mlflow ui`: MLflow's own link to a run page (no `workflowType`) opens it in
    GenAI mode (breadcrumb `Evaluations`), so the printed run link says `workflowType=machine_learning` and opens the
    classic run view (breadcrumb `Runs`, the sidebar's Model training items); the winner link's table shows its
    metric columns at the widths the shared view sets, wider than MLflow's 100 px."""
    import re

    from pipelines.tracking.links import WINNER_COLUMNS, run_link, runs_link
    from pipelines.tracking.store import experiment
    from tests.mlflow_checks import rendered_pages

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client, cfg = client_of(uri), tracking_cfg(uri, tmp_path)
    experiment_id = experiment(client, "regraft", str(tmp_path / "mlartifacts"))
    parent = client.create_run(experiment_id, tags={"kind": "pipeline"}, run_name="defaults · 12-07 11:24:38")
    for number, name in enumerate(WINNER_COLUMNS):
        client.log_metric(parent.info.run_id, name, 1.0 + number)
    client.set_terminated(parent.info.run_id)
    table = runs_link(client, experiment_id, cfg, None)
    printed = run_link(table, parent.info.run_id)
    assert printed == f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{parent.info.run_id}" \
                      "?workflowType=machine_learning"
    own, classic, runs = rendered_pages(uri, [printed.split("?")[0], printed, table], tmp_path / "chromium")
    crumb = r'data-testid="experiment-observatory-link-runs" href="[^"]*">(\w+)<'
    assert re.findall(crumb, own) == ["Evaluations"], own[-2000:]  # MLflow's own link: GenAI mode
    assert re.findall(crumb, classic) == ["Runs"], classic[-2000:]
    assert "Model registry" in classic and "defaults · 12-07 11:24:38" in classic
    widths = dict(re.findall(r'col-id="metrics.`([^`]+)`" aria-sort="[^"]*" aria-description="[^"]*" '
                             r'style="left: \d+px; width: (\d+)px;"', runs))
    assert set(widths) == set(WINNER_COLUMNS), runs[-2000:]
    assert all(int(widths[name]) >= 9 * len(name) + 24 for name in WINNER_COLUMNS), widths
