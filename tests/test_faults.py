"""Faults that must never cost a result (issue: faults never cost a result), on real `regraft debug=tiny` runs:

- a tracking server killed mid-run: the run ends as fast as one without tracking, keeps what the store did not take
  in its outbox, and the next command (here `python -m pipelines.tracking.outbox`) puts every figure into the store;
- `kill -9` of regraft: the next command closes the runs it left RUNNING as KILLED;
- a cache output changed after it was written (truncated, bytes flipped at the same size, a file deleted): it is
  not reused but computed again (or, under cache.on_mismatch=stop, named in one line).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.core.cache import CacheCheck
from stages.common.contract.artifacts import read_manifest, sha256_of, staged_output
from tests.mlflow_checks import check_store, free_port, start_mlflow_server, stop_mlflow_server

ROOT = Path(__file__).resolve().parents[1]


def regraft_command(outputs: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", "debug=tiny", *overrides]


def regraft(outputs: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(regraft_command(outputs, *overrides), cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def run_until(command: list[str], line_has: str) -> tuple[subprocess.Popen, list[str]]:
    """Start a command and read its output until a line contains `line_has`."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line_has in line:
            return process, lines
    process.wait()
    raise AssertionError(f"never saw {line_has!r}:\n" + "".join(lines)[-3000:])


def last_summary(outputs: Path) -> dict:
    return json.loads((sorted((outputs / "runs").iterdir())[-1] / "summary.json").read_text())


def ran(summary: dict) -> set[str]:
    return {name for name, stage in summary["stages"].items() if not stage["hit"]}


@pytest.mark.slow
def test_a_tracking_server_killed_mid_run_costs_no_time_and_no_figure(tmp_path):
    quiet = tmp_path / "untracked"
    started = time.perf_counter()
    assert regraft(quiet, "tracking.enabled=false").returncode == 0
    untracked_s = time.perf_counter() - started

    port, store = free_port(), tmp_path / "server"
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(store, port)
    outputs = tmp_path / "tracked"
    started = time.perf_counter()
    run, lines = run_until(regraft_command(outputs, f"tracking.uri={uri}"), "vocab_map")
    stop_mlflow_server(server, signal.SIGKILL)
    rest, _ = run.communicate(timeout=900)
    tracked_s = time.perf_counter() - started
    out = "".join(lines) + rest
    assert run.returncode == 0, out[-3000:]
    # ~3 s of timeouts, never MLflow's own retries (4.5 minutes); the bound leaves room for what the other xdist
    # worker runs meanwhile, which moved one run against the other by 30 s in a full suite on 2 cores
    assert tracked_s < untracked_s + 120, (tracked_s, untracked_s)
    said = [line for line in out.splitlines() if line.startswith("tracking:")]
    assert len(said) == 1 and "stopped answering" in said[0] and f"{outputs / 'outbox'}" in said[0], said
    assert list((outputs / "outbox").glob("*.json"))

    server = start_mlflow_server(store, port)  # the store is back
    try:
        sent = subprocess.run([sys.executable, "-m", "pipelines.tracking.outbox", str(outputs / "outbox")], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert sent.returncode == 0 and "sent" in sent.stdout, sent.stdout + sent.stderr
        assert not list((outputs / "outbox").glob("*.json"))
        assert check_store(uri) == 13  # every child holds its own output's figures, none is left RUNNING
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name("regraft")
        [parent] = client.search_runs([experiment.experiment_id], "tags.kind = 'pipeline'")
        assert parent.info.status == "FINISHED"
        assert {key: parent.data.metrics[key] for key in last_summary(outputs)["numbers"]} == \
            last_summary(outputs)["numbers"]
    finally:
        stop_mlflow_server(server)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    """A run killed with SIGKILL after its first stages, then run again to the end."""
    outputs = tmp_path_factory.mktemp("faults")
    run, _ = run_until(regraft_command(outputs), "vocab_map")
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    return outputs


@pytest.mark.slow
def test_runs_a_killed_regraft_left_running_are_closed_by_the_next_command(killed_run):
    from mlflow.tracking import MlflowClient

    done = regraft(killed_run)
    assert done.returncode == 0, done.stdout[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("tracking: closed")]
    assert len(said) == 1, done.stdout[-3000:]
    check_store(f"sqlite:///{killed_run}/mlflow.db")
    client = MlflowClient(f"sqlite:///{killed_run}/mlflow.db")
    experiment = client.get_experiment_by_name("regraft")
    killed = client.search_runs([experiment.experiment_id], "attributes.status = 'KILLED'")
    assert killed and all("was gone" in run.data.tags["closed_because"] for run in killed)
    assert f"closed {len(killed)} runs" in said[0]


@pytest.mark.slow
def test_a_changed_cache_output_is_computed_again_never_reused(killed_run):
    before = last_summary(killed_run)
    outs = {name: Path(stage["out"]) for name, stage in before["stages"].items()}
    weights = outs["remap"] / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    shard = sorted(outs["features"].rglob("*.safetensors"))[0]
    with shard.open("r+b") as handle:  # 16 bytes flipped in the middle: the same size
        handle.seek(shard.stat().st_size // 2)
        middle = handle.read(16)
        handle.seek(-16, os.SEEK_CUR)
        handle.write(bytes(b ^ 0xFF for b in middle))
    (outs["finetune"] / "drafter" / "config.json").unlink()

    done = regraft(killed_run)
    assert done.returncode == 0, done.stdout[-3000:]
    again = last_summary(killed_run)
    assert ran(again) == {"remap", "features", "finetune"}  # what reads them is keyed by them, and still complete
    assert again["numbers"] == before["numbers"]  # computed again, the same figures
    said = [line for line in done.stdout.splitlines() if "cache:" in line]
    assert len(said) == 3 and any("no longer has the sha256" in line for line in said), said
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{killed_run}/mlflow.db")
    experiment = client.get_experiment_by_name("regraft")
    [remap] = client.search_runs([experiment.experiment_id], "tags.node = 'remap'", order_by=["start_time DESC"],
                                 max_results=1)
    assert remap.data.tags["sha256.model.safetensors"] == sha256_of(weights)  # the file as it is now

    compare = outs["compare"] / "compare.json"
    compare.write_bytes(compare.read_bytes()[:-1] + b"#")
    stopped = regraft(killed_run, "cache.on_mismatch=stop")
    assert stopped.returncode == 1
    last = stopped.stdout.strip().splitlines()[-1]
    assert last.startswith("error:") and f"rm -r {outs['compare']}" in last and "sha256" in last, last


def test_auto_hashes_small_outputs_and_large_ones_only_where_mtime_moved(tmp_path):
    with staged_output(tmp_path / "out", "demo") as staged:
        (staged.path / "a.bin").write_bytes(b"a" * 4096)
        (staged.path / "b.bin").write_bytes(b"b" * 4096)
    out = tmp_path / "out"
    assert read_manifest(out)["checksums"]["a.bin"]["bytes"] == 4096
    flipped = out / "a.bin"
    recorded = flipped.stat()
    flipped.write_bytes(b"x" * 4096)
    large = CacheCheck(verify="auto", hash_limit_gb=0)  # every output is over the limit
    assert "a.bin no longer has the sha256" in CacheCheck(verify="auto").problem(out)
    assert "a.bin no longer has the sha256" in large.problem(out)  # its mtime moved: hashed
    os.utime(flipped, ns=(recorded.st_atime_ns, recorded.st_mtime_ns))  # the same bytes changed, mtime put back
    assert large.problem(out) is None  # what auto does not see above the limit: the price of not reading TBs
    assert "a.bin no longer has the sha256" in CacheCheck(verify="hash", hash_limit_gb=0).problem(out)
    assert CacheCheck(verify="size").problem(out) is None
    os.truncate(out / "b.bin", 10)
    assert CacheCheck(verify="size").problem(out) == "b.bin is 10 bytes, its manifest says 4096"
