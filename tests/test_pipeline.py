"""The whole pipeline on a tiny built-in world through submitit's local executor: every stage once, the cache,
sweeps, MLflow runs checked with MlflowClient, and recovery from a run killed while holding a stage's lock."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["debug=tiny"]
NODES = ["world", "source_map", "source_drafter", "probe", "vocab_map", "compare", "remap", "diagnose", "features",
         "finetune", "evaluate", "baseline_finetune", "baseline_evaluate"]
NODE_STAGES = ("world", "vocab_map", "finetune", "probe", "compare", "remap", "diagnose", "features")

pytestmark = pytest.mark.slow


def regraft(outputs: Path, *overrides: str, multirun: bool = False, python: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    command = [sys.executable, *python, "-m", "pipelines.regraft", *(["-m"] if multirun else []), f"paths.outputs={outputs}",
               *TINY, *overrides]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)


def last_summary(outputs: Path) -> dict:
    return json.loads((sorted((outputs / "runs").iterdir())[-1] / "summary.json").read_text())


def ran(summary: dict) -> set[str]:
    return {name for name, stage in summary["stages"].items() if not stage["hit"]}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def first_run(outputs) -> dict:
    done = regraft(outputs)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mlflow ui --port 5000 --backend-store-uri" in done.stdout
    return last_summary(outputs)


def mlflow_client(outputs: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{outputs}/mlflow.db")


def child_runs(client, parent_id: str) -> dict:
    experiment = client.get_experiment_by_name("regraft")
    runs = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return {run.data.tags["node"]: run for run in runs}


def parent_runs(client) -> list:
    experiment = client.get_experiment_by_name("regraft")
    return client.search_runs([experiment.experiment_id], "tags.kind = 'pipeline'", order_by=["start_time ASC"])


def test_every_stage_runs_once_through_submitit_and_is_tracked(first_run, outputs):
    stages = first_run["stages"]
    assert list(stages) == NODES and ran(first_run) == set(NODES)
    for name, stage in stages.items():
        manifest = json.loads((Path(stage["out"]) / "manifest.json").read_text())
        assert manifest["complete"] and len(stage["key"]) == 16, name
        assert Path(stage["out"]).parent.name == stage["stage"]
    assert stages["source_drafter"]["metrics"]["val_full_acc_0"] > 4 / 128  # the source drafter is well above chance
    run_dir = sorted((outputs / "runs").iterdir())[-1]
    assert "serving" in (run_dir / "jobs" / "warm.log").read_text()  # the jobs forked from the warm interpreter
    assert 1.0 <= stages["evaluate"]["metrics"]["accept_len"] <= 4.0
    assert stages["remap"]["metrics"]["rows_remapped"] == stages["compare"]["metrics"]["shared_ids"]
    assert list((run_dir / "jobs").iterdir())  # submitit job folders and logs
    numbers = first_run["numbers"]
    assert {"phase0/accept_len", "phase1/accept_len", "scratch/accept_len", "phase0/loss_0",
            "phase1/loss_0", "phase1/val_acc_0"} <= set(numbers)
    assert not (run_dir / "jobs" / "%j").exists()  # one job folder per stage, no empty "%j"

    from pipelines.tracking.run_names import started

    client = mlflow_client(outputs)
    experiment = client.get_experiment_by_name("regraft")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on its runs
    parent = parent_runs(client)[-1]
    assert parent.info.status == "FINISHED" and parent.info.run_name == f"debug=tiny · {started(run_dir)}"
    assert {key: parent.data.metrics[key] for key in numbers} == numbers  # the summary's numbers, by the same names
    assert parent.data.metrics["stages/ran"] == len(NODES) and parent.data.metrics["stages/hit"] == 0
    children = child_runs(client, parent.info.run_id)
    assert set(children) == set(NODES)
    assert children["evaluate"].data.metrics["accept_len"] == numbers["phase1/accept_len"]
    for phase, node in (("phase0", "probe"), ("phase1", "evaluate"), ("scratch", "baseline_evaluate")):
        for name in ("prose", "code"):  # the world's two eval sets, each beside the aggregate, in both places
            assert numbers[f"{phase}/accept_len/{name}"] == children[node].data.metrics[f"accept_len/{name}"]
            assert parent.data.metrics[f"{phase}/accept_len/{name}"] == numbers[f"{phase}/accept_len/{name}"]
    finetune = children["finetune"]
    assert finetune.data.params["lr"] == "0.003" and finetune.data.params["init"] == "remap"
    assert finetune.data.params["deepspeed.zero_stage"] == "0"
    assert finetune.data.tags["cache_hit"] == "false" and finetune.data.tags["cache_key"] == stages["finetune"]["key"]
    assert finetune.data.tags["stage"] == "finetune" and finetune.data.tags["phase"] == "1"
    history = client.get_metric_history(finetune.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    lrs = [m.value for m in sorted(client.get_metric_history(finetune.info.run_id, "train/lr"), key=lambda m: m.step)]
    assert len(lrs) == 4 and min(lrs) > 0 and max(lrs) == pytest.approx(0.003)  # every step trains (no lr 0)
    assert finetune.data.metrics["val/full_acc_0"] == stages["finetune"]["metrics"]["val_full_acc_0"]
    assert numbers["phase1/val_acc_0"] == stages["finetune"]["metrics"]["val_full_acc_0"]
    names = set(finetune.data.metrics)  # one name per figure: no `val.loss` beside `val_loss`
    assert not [name for name in names if "." in name or name.startswith(("val_", "preflight_"))], names
    assert {"train/loss", "val/loss", "preflight/loss_0", "stage_seconds"} <= names
    assert {"accept_len", "turn/accept_len"} <= set(children["probe"].data.metrics)
    assert "sha256.drafter/model.safetensors" in finetune.data.tags
    artifacts = {item.path for item in client.list_artifacts(children["evaluate"].info.run_id)}
    assert {"manifest.json", "per_prompt.csv", "report.json", "acceptance.png"} <= artifacts
    assert {item.path for item in client.list_artifacts(parent.info.run_id)} >= {"summary.json", "accept_len.png",
                                                                                  "per_step_accuracy.png"}


def test_a_second_run_runs_nothing_yet_tracks_every_stage(first_run, outputs):
    done = regraft(outputs, python=("-X", "importtime"))
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "omegaconf" in imported and "torch" not in imported  # no stage runs here, so neither torch nor stage code
    assert "mlflow" not in imported  # the store's agent keeps it (pipelines/tracking/store_agent.py)
    assert not {name for name in imported if name.startswith("stages.") and name.split(".")[1] in NODE_STAGES}
    again = last_summary(outputs)
    assert ran(again) == set()
    assert again["numbers"] == first_run["numbers"]
    client = mlflow_client(outputs)
    first, parent = parent_runs(client)[-2:]
    assert parent.data.metrics["stages/ran"] == 0 and parent.data.metrics["stages/hit"] == len(NODES)
    children, originals = child_runs(client, parent.info.run_id), child_runs(client, first.info.run_id)
    assert set(children) == set(NODES) and {run.data.tags["cache_hit"] for run in children.values()} == {"true"}
    assert children["finetune"].data.metrics["val/loss"] == first_run["stages"]["finetune"]["metrics"]["val_loss"]
    for name, run in children.items():  # no second upload: the first run's child holds the artifacts
        assert run.data.tags["artifacts_run"] == originals[name].info.run_id, name
        assert not client.list_artifacts(run.info.run_id), name
        assert run.data.metrics["stage_seconds"] == originals[name].data.metrics["stage_seconds"], name
    # the plots of the same outputs, kept once under cache/plots/ and copied, not drawn again
    first_dir, again_dir = sorted((outputs / "runs").iterdir())[-2:]
    kept = list((outputs / "cache" / "plots").iterdir())
    for name in ("per_step_accuracy.png", "loss_curves.png", "accept_len.png"):
        assert (again_dir / name).read_bytes() == (first_dir / name).read_bytes() == \
            next(folder / name for folder in kept if folder.is_dir()).read_bytes()


def test_a_changed_option_reruns_exactly_the_stages_downstream(first_run, outputs):
    done = regraft(outputs, "remap.fallback=mean")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran(last_summary(outputs)) == {"remap", "diagnose", "finetune", "evaluate"}


def test_a_sweep_runs_shared_stages_once(first_run, outputs):
    sweep = ["finetune.lr=1e-3", "finetune.init=remap,scratch"]
    done = regraft(outputs, *sweep, multirun=True)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep_dir = sorted((outputs / "sweeps").iterdir())[-1]
    members = json.loads((sweep_dir / "summary.json").read_text())["members"]
    assert len(members) == 2
    # Two finetunes and their evaluations: the remap one, and the scratch one, which is the remap member's baseline
    # and the scratch member's finetune (one key), so it runs once; everything upstream is cached.
    assert [sorted(member["ran"]) for member in members] == [
        ["baseline_evaluate", "baseline_finetune", "evaluate", "finetune"], []]
    assert json.loads((sweep_dir / "summary.json").read_text())["swept"] == ["finetune.init"]
    client = mlflow_client(outputs)
    members = {run.data.tags.get("member"): run for run in parent_runs(client)[-2:]}
    assert {run.info.run_name for run in members.values()} == {"init=remap", "init=scratch"}  # what varies, only
    for number, run in members.items():
        assert run.data.tags["sweep"] == sweep_dir.name and run.data.tags["swept"] == "finetune.init"
        children = child_runs(client, run.info.run_id)
        assert {child.data.tags["finetune.init"] for child in children.values()} == {run.data.tags["finetune.init"]}
    scratch = members["1"]  # its fine-tune is its baseline: one result, said once
    assert scratch.data.tags["finetune.init"] == "scratch" and scratch.data.tags["phase1_is_scratch"] == "true"
    assert "phase1/accept_len" in scratch.data.metrics and "scratch/accept_len" not in scratch.data.metrics
    assert child_runs(client, scratch.info.run_id)["baseline_finetune"].data.tags["same_computation_as"] == "finetune"
    again = regraft(outputs, *sweep, multirun=True)
    assert again.returncode == 0, again.stderr[-3000:]
    members = json.loads((sorted((outputs / "sweeps").iterdir())[-1] / "summary.json").read_text())["members"]
    assert [member["ran"] for member in members] == [[], []]


def test_a_run_killed_while_holding_a_stage_lock_does_not_block_the_next(first_run, outputs):
    compare_out = Path(first_run["stages"]["compare"]["out"])
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from pipelines.core.cache import stage_lock
        out = Path({str(compare_out)!r})
        lock = stage_lock(out)
        lock.acquire()
        (out.parent / ("." + out.name + ".tmp-deadbeef")).mkdir()
        print("locked", flush=True)
        time.sleep(600)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    shutil.rmtree(compare_out)  # the output the killed run was about to replace
    done = regraft(outputs)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran(last_summary(outputs)) == {"compare"}
    assert not list(compare_out.parent.glob(f".{compare_out.name}.tmp-*"))  # the dead run's temp folder is gone


def test_sigterm_cancels_the_running_stages_and_marks_the_runs_killed(tmp_path):
    def processes() -> list[tuple[int, str]]:  # (session id, command line): the run leads a session of its own
        lines = subprocess.run(["ps", "-eo", "sid=,args="], capture_output=True, text=True).stdout.splitlines()
        return [(int(sid), args) for sid, _, args in (line.strip().partition(" ") for line in lines)]

    # a world that trains long: the tiny one can finish within the 3 s a cancelled stage is given to end, and is then
    # complete (seen in full-suite runs on idle cores)
    command = [sys.executable, "-m", "pipelines.regraft", f"paths.outputs={tmp_path}", *TINY, "world.steps_a=5000"]
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    lines = []
    while not any("dispatched" in line for line in lines):
        lines.append(run.stdout.readline())
        assert lines[-1] or run.poll() is None, "".join(lines)
    for _ in range(300):  # until the world's job is inside the stage: it holds the stage's lock
        if list((tmp_path / "cache").glob("world/*.lock")):
            break
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    output = "".join(lines) + run.stdout.read()
    assert run.wait(timeout=60) == 130, output
    assert "interrupted: the running stages were cancelled" in output
    client = mlflow_client(tmp_path)
    parent = parent_runs(client)[-1]
    world_run = child_runs(client, parent.info.run_id)["world"]
    assert parent.info.status == "KILLED" and world_run.info.status == "KILLED"
    assert world_run.data.tags["error"] == "cancelled: regraft was interrupted"

    def leftovers() -> str:  # the run's job controllers, clients and warm interpreter (what other tests run is not)
        return "\n".join(args for sid, args in processes() if sid == run.pid or str(tmp_path) in args)

    for _ in range(100):
        if not leftovers():
            break
        time.sleep(0.2)
    assert not leftovers()
    world = tmp_path / "cache" / "world"
    assert list(world.glob("*.lock")) and not list(world.glob("*/manifest.json"))  # stopped inside, never complete


@pytest.mark.parametrize("family", ["eagle3.1", "mla", "mla3.1"])
def test_the_whole_pipeline_runs_on_every_drafter_family(family, first_run, outputs):
    """source.build.family: the built-in source drafter, its remap, diagnose's re-alignment, both fine-tunes and the
    three measurements all of that family (the baseline is built from scratch in the source's family)."""
    done = regraft(outputs, f"source.build.family={family}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = last_summary(outputs)
    assert list(summary["stages"]) == NODES
    assert ran(summary) == set(NODES) - {"world", "source_map", "vocab_map"}  # the world and both maps are shared
    for name in ("source_drafter", "remap", "finetune", "baseline_finetune", "diagnose"):
        drafter = Path(summary["stages"][name]["out"])
        config = drafter / "drafter" / "config.json" if (drafter / "drafter").exists() else drafter / "config.json"
        if name == "diagnose":
            config = drafter / "realigned" / "config.json"
        assert json.loads(config.read_text())["regraft"]["family"].startswith(family), name
    for name in ("probe", "evaluate", "baseline_evaluate"):
        manifest = json.loads((Path(summary["stages"][name]["out"]) / "manifest.json").read_text())
        assert manifest["headline"].startswith(family) and manifest["metrics"]["accept_len"] >= 1.0, name


def test_plots_are_drawn_once_per_content_and_again_when_it_changes(first_run, outputs, tmp_path, monkeypatch):
    """plot() with the cache: the same outputs' plots are copied from cache/plots/ (nothing drawn); another output
    (a changed key) gets plots of its own."""
    from pipelines.report import summary

    stages = first_run["stages"]
    drawn = []
    real_draw = summary.draw_plots
    monkeypatch.setattr(summary, "draw_plots", lambda results, folder: drawn.append(folder) or real_draw(results, folder))
    cache = tmp_path / "cache"
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        summary.plot(stages, tmp_path / run, cache)
    assert len(drawn) == 1
    assert (tmp_path / "a" / "loss_curves.png").read_bytes() == (tmp_path / "b" / "loss_curves.png").read_bytes()
    changed = {**stages, "finetune": {**stages["finetune"], "key": "0" * 16}}
    (tmp_path / "c").mkdir()
    summary.plot(changed, tmp_path / "c", cache)
    assert len(drawn) == 2 and len([p for p in (cache / "plots").iterdir() if p.is_dir()]) == 2
