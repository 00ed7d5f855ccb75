"""The store agent (pipelines/tracking/store_agent.py) against a real sqlite store: commands (processes that drive a Tracker as
regraft does) hand it their records and never import mlflow themselves; one agent serves a store's commands, keeps
the store open between them, ends when idle, and refuses a store regraft cannot use with the line a command would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipelines.tracking.outbox import Outbox
from pipelines.tracking.run_names import invocation
from pipelines.tracking.store_agent import agent_settings, listening, socket_path, stop_agents, wants_agent
from pipelines.tracking.tracker import Tracker
from stages.common.contract.errors import RegraftError

ROOT = Path(__file__).resolve().parents[1]

COMMAND = """
import json, sys
from omegaconf import OmegaConf
from pipelines.tracking.run_names import invocation
from pipelines.tracking.tracker import Tracker
cfg = OmegaConf.create(json.loads(sys.argv[1]))
tracker = Tracker(cfg, invocation([f"finetune.seed={sys.argv[2]}"]), tags={})
tracker.finish("FINISHED", {"seed": sys.argv[2]}, {"phase1/accept_len": float(sys.argv[2])}, [])
print(json.dumps({"parent": tracker.parent_id, "link": tracker.runs_link(),
                  "mlflow_imported": any(name.split(".")[0] == "mlflow" for name in sys.modules)}))
"""


def agent_cfg(outputs: Path, idle_s: float = 60.0):
    return OmegaConf.create({"enabled": True, "uri": f"sqlite:///{outputs}/mlflow.db", "experiment": "regraft",
                             "artifact_location": str(outputs / "mlartifacts"), "copy_checkpoints": False,
                             "max_artifact_mb": 20.0, "timeout_s": 10.0, "retries": 1,
                             "outbox": str(outputs / "outbox"), "agent": True, "agent_idle_s": idle_s})


def command(cfg, seed: int, cwd: Path = ROOT) -> dict:
    done = subprocess.run([sys.executable, "-c", COMMAND, json.dumps(OmegaConf.to_container(cfg)), str(seed)],
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def agent_log(cfg) -> str:
    return Path(str(socket_path(agent_settings(cfg))) + ".log").read_text()


def ended(path: Path) -> None:
    """Wait until the agent at `path` has ended: its socket gone and its process too."""
    import psutil

    pid = int(Path(str(path) + ".log").read_text().splitlines()[-1].split("[")[1].split("]")[0])
    deadline = time.monotonic() + 30
    while (path.exists() or psutil.pid_exists(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not listening(path) and not path.exists() and not psutil.pid_exists(pid)


def test_commands_hand_their_records_to_one_agent_and_never_import_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = agent_cfg(tmp_path / "outputs")
    first, second = command(cfg, 1), command(cfg, 2)
    assert not first["mlflow_imported"] and not second["mlflow_imported"]
    assert first["link"].startswith("http://127.0.0.1:5000/#/experiments/") and first["link"] == second["link"]
    client = MlflowClient(cfg.uri)
    for seed, ran in ((1, first), (2, second)):
        run = client.get_run(ran["parent"])
        assert run.info.status == "FINISHED" and run.info.run_name == f"seed={seed}"
        assert run.data.metrics == {"phase1/accept_len": float(seed)} and run.data.params == {"seed": str(seed)}
    log = agent_log(cfg)
    assert log.count("store opened") == 1 and log.count("serving") == 1  # opened once for both commands
    assert listening(socket_path(agent_settings(cfg)))


def test_an_idle_agent_ends_and_the_next_command_starts_another(tmp_path):
    cfg = agent_cfg(tmp_path / "outputs", idle_s=1.0)
    path = socket_path(agent_settings(cfg))
    command(cfg, 1)
    ended(path)
    assert agent_log(cfg).rstrip().endswith("done")
    command(cfg, 2)
    assert agent_log(cfg).count("store opened") == 2


def test_a_relative_store_is_the_commands_own(tmp_path):
    """`paths.outputs` is relative by default: the agent writes where the command would, whatever its own folder."""
    from mlflow.tracking import MlflowClient

    relative = OmegaConf.create({**OmegaConf.to_container(agent_cfg(Path("outputs"))), "agent_idle_s": 5.0})
    ran = command(relative, 3, cwd=tmp_path)
    run = MlflowClient(f"sqlite:///{tmp_path}/outputs/mlflow.db").get_run(ran["parent"])
    assert run.data.metrics == {"phase1/accept_len": 3.0}  # in the command's folder's store, not the agent's
    assert stop_agents(str(tmp_path)) == 1


def test_each_store_has_its_own_agent(tmp_path):
    one, two = agent_settings(agent_cfg(tmp_path / "one")), agent_settings(agent_cfg(tmp_path / "two"))
    assert socket_path(one) != socket_path(two) and socket_path(one) == socket_path(dict(one))
    assert len(str(socket_path(one))) < 100  # a unix socket's path has at most 107 bytes


def test_a_store_that_cannot_be_migrated_is_refused_through_the_agent_in_one_line(tmp_path):
    import sqlalchemy

    cfg = agent_cfg(tmp_path / "outputs")
    command(cfg, 1)
    assert stop_agents(str(tmp_path)) == 1  # the next command finds the store as it is now, not as its agent has it
    ended(socket_path(agent_settings(cfg)))
    engine = sqlalchemy.create_engine(cfg.uri)
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text("UPDATE alembic_version SET version_num = 'deadbeef0000'"))
    engine.dispose()
    Outbox.opened.clear()
    with pytest.raises(RegraftError) as error:
        Tracker(cfg, invocation([]), tags={})
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "outputs" / "mlflow.db") in message
    assert "deadbeef0000" in message and f"mv {tmp_path / 'outputs' / 'mlflow.db'}" in message


def test_a_command_whose_agent_went_away_opens_the_store_itself(tmp_path, monkeypatch):
    """The agent answered, then ended before the command's first record (killed, say): the command's Tracker opens
    the store here, as with tracking.agent=false, and every record still lands."""
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.store_agent import AgentOutbox

    cfg = agent_cfg(tmp_path / "outputs")
    monkeypatch.setattr(AgentOutbox, "reach", classmethod(lambda cls, cfg: cls(cfg, tmp_path / "gone.sock")))
    Outbox.opened.clear()
    tracker = Tracker(cfg, invocation(["finetune.seed=4"]), tags={})
    tracker.finish("FINISHED", {}, {"phase1/accept_len": 4.0}, [])
    assert MlflowClient(cfg.uri).get_run(tracker.parent_id).data.metrics == {"phase1/accept_len": 4.0}
    assert tracker.runs_link().startswith("http://127.0.0.1:5000/#/experiments/")
    Outbox.opened.clear()


@pytest.mark.parametrize("uri, chosen, wanted", [
    ("sqlite:///outputs/mlflow.db", None, True), ("sqlite:////abs/mlflow.db", None, True),
    ("file:///srv/mlruns", None, True), ("mlruns", None, True),
    ("http://mlflow.team:5000", None, False), ("https://mlflow.team", None, False), ("databricks", None, False),
    ("http://mlflow.team:5000", True, True), ("sqlite:///outputs/mlflow.db", False, False)])
def test_an_unset_agent_serves_a_store_on_this_machine_and_not_a_server(uri, chosen, wanted):
    assert wants_agent(OmegaConf.create({"uri": uri, "agent": chosen})) is wanted


def test_the_default_agent_serves_the_default_store(tmp_path):
    cfg = agent_cfg(tmp_path)
    cfg.agent = None  # the schema's default
    command(cfg, 1)
    assert listening(socket_path(agent_settings(cfg)))
    assert command(cfg, 2)["mlflow_imported"] is False

