"""A killed op build's lock (stages/finetune/op_builds.py): taken over when older than any build takes, waited on
while younger, and a fine-tune through `regraft` that meets an old one trains instead of hanging."""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from stages.finetune.op_builds import take_over_stale_build_locks
from tests.test_bad_inputs import complete_stages, inputs, output_lines, regraft  # noqa: F401 (a fixture)


def lock_of(root: Path, op: str, age_s: float) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_lock_older_than_any_build_is_taken_over(tmp_path):
    lock = lock_of(tmp_path, "deepspeed_shm_comm", age_s=3 * 3600)
    [line] = take_over_stale_build_locks(tmp_path)
    assert not lock.exists()
    assert line.startswith(f"took over {lock}: left 180 min ago by an op build that was killed partway")


def test_a_young_lock_is_waited_on_until_its_build_releases_it(tmp_path):
    lock = lock_of(tmp_path, "fused_adam", age_s=5)
    released = threading.Timer(0.5, lock.unlink)
    released.start()
    started = time.monotonic()
    assert take_over_stale_build_locks(tmp_path, stale_after_s=3600, poll_s=0.05) == []
    assert time.monotonic() - started >= 0.4  # it waited for the build, and took nothing over
    released.join()


def test_a_young_lock_whose_build_died_is_taken_over_once_it_is_old(tmp_path):
    lock = lock_of(tmp_path, "py311_cu128/fused_adam", age_s=0)
    [line] = take_over_stale_build_locks(tmp_path, stale_after_s=0.3, poll_s=0.05)
    assert not lock.exists() and "fused_adam/lock" in line


@pytest.mark.skipif(not (Path(sys.prefix) / "torch_extensions").is_dir(), reason="the venv's built CPU ops (make venv)")
def test_a_fine_tune_meeting_a_killed_builds_lock_trains(inputs, tmp_path, monkeypatch):  # noqa: F811
    """torch takes the op's lock at every load, so today's lock left by a killed build hung every fine-tune."""
    extensions = tmp_path / "torch_extensions"
    shutil.copytree(Path(sys.prefix) / "torch_extensions", extensions)
    lock = lock_of(extensions, "deepspeed_shm_comm", age_s=3600)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    done = regraft(tmp_path / "outputs", inputs, "pipeline.probe=false", "pipeline.diagnose=false",
                   "pipeline.baseline=false", "pipeline.evaluate=false")
    assert done.returncode == 0, output_lines(done)[-5:]
    assert "finetune" in complete_stages(tmp_path / "outputs") and not lock.exists()
    logs = "".join(path.read_text(errors="replace") for path in (tmp_path / "outputs" / "runs").rglob("*")
                   if path.is_file())  # the stage's job log (jobs/finetune/<id>_0_log.err)
    assert f"finetune: took over {lock}: left 60 min ago" in logs
