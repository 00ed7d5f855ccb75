"""The Slurm fixture's clean-up of crashed sessions (tests/slurm_cluster.py::reap_stale), without a cluster.

A CI machine that ran the suite before keeps /tmp/regraft-slurm/s-* folders whose controller is gone: scancel
against such a folder retries a dead slurmctld for minutes, so the reaper must not ask it; a folder another session
is still creating (no owner.pid yet) must be left alone.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from slurm_cluster import reap_stale


def _session_folder(base: Path, name: str, owner: int | None) -> Path:
    folder = base / name
    folder.mkdir(parents=True)
    (folder / "slurm.conf").write_text("SlurmctldHost=localhost\nSlurmctldPort=1\n")
    if owner is not None:
        (folder / "owner.pid").write_text(str(owner))
    return folder


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_crashed_session_whose_controller_is_gone_is_removed_without_asking_it(tmp_path: Path) -> None:
    folder = _session_folder(tmp_path, "s-crashed", owner=_dead_pid())
    (folder / "slurmctld.pid").write_text(str(_dead_pid()))
    started = time.monotonic()
    notes = reap_stale(tmp_path)
    assert not folder.exists()
    assert time.monotonic() - started < 5, "reap_stale waited on a controller that is gone"
    assert notes == []


def test_live_and_just_created_sessions_are_kept(tmp_path: Path) -> None:
    live = _session_folder(tmp_path, "s-live", owner=os.getpid())
    being_created = _session_folder(tmp_path, "s-new", owner=None)
    old_ownerless = _session_folder(tmp_path, "s-old", owner=None)
    an_hour_ago = time.time() - 3600
    os.utime(old_ownerless, (an_hour_ago, an_hour_ago))
    reap_stale(tmp_path)
    assert live.exists() and being_created.exists()
    assert not old_ownerless.exists()
