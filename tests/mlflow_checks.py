"""What every MLflow store a regraft run leaves must hold, whatever ran beside it (sweeps, runs started together):

- no run of any status is left RUNNING, and no child run says `cache_hit=pending`;
- a child run that names a cache output (`out`) is that node's output: its stage and key, the output the member's
  summary.json gives for the node, and every figure and series point equal to what that output's manifest and
  per-step logs hold, as pipelines/tracking/store.py names them.
"""
from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from pipelines.tracking.store import stage_metrics
from stages.common.contract.artifacts import read_manifest


def all_runs(client: MlflowClient, experiment: str = "regraft") -> list:
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], max_results=5000) if found else []


def expected_figures(out: Path) -> dict[tuple[str, int], float]:
    """(metric, step) -> value, as the tracker logs a stage output (stage_seconds aside: a hit keeps the original's)."""
    manifest = read_manifest(out) or {}
    return {(name, step): value for name, value, step in stage_metrics(manifest.get("metrics", {}), out)}


def logged_figures(client: MlflowClient, run) -> dict[tuple[str, int], float]:
    figures = {}
    for name in run.data.metrics:
        if name != "stage_seconds":
            figures.update({(name, point.step): point.value for point in client.get_metric_history(run.info.run_id,
                                                                                                     name)})
    return figures


def member_outputs(parents: list) -> dict[str, dict[str, str]]:
    """parent run id -> {node: its output}, from each member's summary.json."""
    outputs = {}
    for parent in parents:
        summary = Path(parent.data.tags["run_dir"]) / "summary.json"
        stages = json.loads(summary.read_text())["stages"] if summary.exists() else {}
        outputs[parent.info.run_id] = {node: stage["out"] for node, stage in stages.items()}
    return outputs


def check_store(uri: str) -> int:
    """Asserts the rules above for every run in the store; returns how many child runs were held to a manifest."""
    client = MlflowClient(uri)
    runs = all_runs(client)
    assert runs, f"no runs in {uri}"
    stuck = [(run.info.run_name, run.info.status, run.data.tags.get("cache_hit")) for run in runs
             if run.info.status == "RUNNING" or run.data.tags.get("cache_hit") == "pending"]
    assert not stuck, f"runs left running or pending: {stuck}"
    parents = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    outputs = member_outputs(parents)
    checked = 0
    for run in runs:
        tags = run.data.tags
        if "mlflow.parentRunId" not in tags or "out" not in tags:
            continue
        out, name = Path(tags["out"]), run.info.run_name
        assert (out.parent.name, out.name) == (tags["stage"], tags["cache_key"]), f"{name}: {out} is not its output"
        own = outputs[tags["mlflow.parentRunId"]].get(tags["node"])
        assert own is None or own == str(out), f"{name}: holds {out}, its member's {tags['node']} is {own}"
        assert logged_figures(client, run) == expected_figures(out), f"{name}: figures differ from {out}"
        checked += 1
    return checked


CHROMIUM = ("chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1600,900",
            "--virtual-time-budget=60000")


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rendered_runs_table(store: str, link: str, scratch: Path) -> str:
    """The page a user sees at `link` (as printed, for `mlflow ui` on port 5000), rendered by headless Chromium
    against a real `mlflow ui` on `store`: the DOM after the app has loaded."""
    return rendered_pages(store, [link], scratch)[0]


def rendered_pages(store: str, links: list[str], scratch: Path) -> list[str]:
    """Each of `links` (for `mlflow ui` on port 5000) rendered by headless Chromium against one real `mlflow ui` on
    `store`, each in a new browser profile (nothing remembered from the page before): the DOMs after the app has
    loaded."""
    import shutil
    import subprocess
    import sys
    import time
    import urllib.request

    import pytest

    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--port", str(port),
                               "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "mlflow ui did not start"
                time.sleep(1)
        pages = []
        for number, link in enumerate(links):
            url = link.replace("http://127.0.0.1:5000", f"http://127.0.0.1:{port}")
            pages.append(subprocess.run([*CHROMIUM, f"--user-data-dir={scratch / str(number)}", "--dump-dom", url],
                                        capture_output=True, text=True, timeout=300).stdout)
        return pages
    finally:
        server.terminate()
        server.wait(timeout=30)


def first_row_run_id(dom: str) -> str | None:
    import re

    found = re.search(r'row-index="0" row-id="([0-9a-f]{32})"', dom)
    return found[1] if found else None


def start_mlflow_server(folder: Path, port: int):
    """A real `mlflow server` on `port` over a sqlite store in `folder` (the same folder again: the same store),
    answering /health; its own process group, so a test can kill it whole."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    folder.mkdir(parents=True, exist_ok=True)
    mlflow = Path(sys.executable).parent / "mlflow"
    server = subprocess.Popen([str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{folder}/server.db",
                               "--default-artifact-root", str(folder / "served")],
                              stdout=(folder / "server.log").open("a"), stderr=subprocess.STDOUT,
                              env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}, start_new_session=True)
    deadline = time.monotonic() + 150
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("mlflow server did not answer /health: "
                                     + (folder / "server.log").read_text()[-2000:]) from None
            time.sleep(0.25)


def stop_mlflow_server(server, signal_number: int = 15) -> None:
    import os

    try:
        os.killpg(server.pid, signal_number)
    except ProcessLookupError:
        pass
    server.wait(timeout=30)
