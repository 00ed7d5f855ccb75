"""A regraft stopped by SIGTERM while a fine-tune runs as a local (warm) job: the fine-tune saves a checkpoint at
its next optimizer step before regraft exits, and the same command resumes it from there, every step logged once."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import pipelines.regraft  # noqa: F401  (registers every schema)
from pipelines.core.cache import keys_for
from pipelines.core.dag import build_nodes
from stages.common.contract.stage import CONF_DIR

ROOT = Path(__file__).resolve().parents[1]
RUN = ["debug=tiny", "pipeline.probe=false", "pipeline.baseline=false", "pipeline.evaluate=false",
       "finetune.max_steps=40", "finetune.epochs=100", "finetune.checkpoint_every=1000", "finetune.log_every=1"]

pytestmark = pytest.mark.slow


def finetune_work(outputs: Path) -> Path:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        keys = keys_for(build_nodes(compose("config", overrides=[f"paths.outputs={outputs}", *RUN])))
    return outputs / "cache" / "finetune" / f"{keys['finetune']}.checkpoints"


def train_steps(work: Path) -> list[int]:
    path = work / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [record["step"] for record in map(json.loads, lines) if record["split"] == "train"]


def test_sigterm_lets_the_finetune_save_and_the_rerun_resumes_from_there(tmp_path):
    command = [sys.executable, "-m", "pipelines.regraft", f"paths.outputs={tmp_path}", *RUN]
    work = finetune_work(tmp_path)
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while len(train_steps(work)) < 3:
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()[-3000:]
        time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    output = run.stdout.read()
    assert run.wait(timeout=120) == 130, output[-3000:]
    saved = int((work / "deepspeed" / "latest").read_text().removeprefix("step"))
    assert 3 <= saved < 40  # written by the signal: the periodic checkpoint is every 1000 steps
    assert "Traceback" not in output

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    logs = sorted((tmp_path / "runs").glob("*/jobs/*/*_log.err"), key=lambda p: p.stat().st_mtime)
    assert any(f"resumed at step {saved} of 40" in log.read_text() for log in logs)
    summary = json.loads(sorted((tmp_path / "runs").glob("*/summary.json"))[-1].read_text())
    finetune_out = Path(summary["stages"]["finetune"]["out"])
    steps = [json.loads(line)["step"] for line in (finetune_out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "train"]
    assert steps == list(range(1, 41))  # every step once: none lost, none repeated
