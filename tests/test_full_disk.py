"""A full disk, for real: `regraft debug=tiny` with its outputs on a small tmpfs (issue 23 §4).

Whatever fills first (a stage's output, a job's log or result, the run folder Hydra makes), the run ends with one
line, `error: <path>: no space left on device (fix: ...)`, no traceback, and the cache holds complete stage outputs
only; with room again, the same command finishes from the stages that were complete. Needs root (mount); skipped
with the reason where mounting a tmpfs is not permitted.
"""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
# debug=tiny writes about 4.3 MB in all (the world alone 1 MB): at 2.5 MB the disk fills after the world, mid-run
MID_RUN = "2500k"
# a path on the disk, then the problem and the fix
FULL_DISK_LINE = re.compile(r"^error: /\S+: no space left on device \(fix: free space on that filesystem, or point "
                            r"paths\.outputs= \(or paths\.cache=\) at a disk with room; ")
STAGE_LINE = re.compile(r"^\s*\S+ (dispatched \(|done in |cached|failed: )")



def mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(done.stderr or done.stdout).strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of MID_RUN bytes at tmp_path/disk, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    mount_tmpfs(disk, MID_RUN)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def regraft(outputs: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.regraft", "debug=tiny", f"paths.outputs={outputs}",
                           "tracking.enabled=false"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "240"})  # no wrapped stage lines


def lines_of(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.strip()]


def assert_one_line_about_the_full_disk(done: subprocess.CompletedProcess) -> None:
    lines = lines_of(done)
    assert done.returncode == 1, lines[-10:]
    assert FULL_DISK_LINE.match(lines[-1]), lines[-10:]
    after_stages = [i for i, line in enumerate(lines) if STAGE_LINE.match(line)]
    assert len(lines) - (after_stages[-1] + 1 if after_stages else 0) <= 2, lines[-10:]
    assert "Traceback" not in done.stdout and "Logging error" not in done.stdout, done.stdout[-3000:]


def stage_outputs(cache: Path) -> dict[str, bool]:
    """Every output folder under the cache (`<stage>/<key>`), and whether its manifest says complete. Hidden temp
    folders (`.KEY.tmp-*`, swept by the next run), locks and a fine-tune's checkpoint folder are no outputs."""
    found = {}
    for folder in cache.glob("*/*"):
        if folder.name.startswith(".") or folder.suffix in (".lock", ".checkpoints"):
            continue
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError):
            manifest = {}
        found[f"{folder.parent.name}/{folder.name}"] = manifest.get("complete") is True
    return found


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_ends_with_one_line_and_loses_no_complete_stage(small_disk):
    done = regraft(small_disk)
    assert_one_line_about_the_full_disk(done)
    outputs = stage_outputs(small_disk / "cache")
    assert outputs and all(outputs.values()), outputs  # the world at least, and nothing half-written

    subprocess.run(["mount", "-o", "remount,size=12m", str(small_disk)], check=True)
    again = regraft(small_disk)
    assert again.returncode == 0, lines_of(again)[-10:]
    reused = [line for line in lines_of(again) if STAGE_LINE.match(line) and " cached" in line]
    assert len(reused) >= len(outputs), lines_of(again)  # every complete stage of the first run is a hit


@pytest.mark.slow
def test_a_disk_full_from_the_start_ends_with_one_line(small_disk):
    filler = small_disk / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # until the disk is full
    done = regraft(small_disk)
    assert_one_line_about_the_full_disk(done)
    assert all(stage_outputs(small_disk / "cache").values())


# Without a disk to fill: how each kind of full-disk error becomes the one line (no root needed).

def test_a_write_error_names_its_file_or_else_the_folder_being_written(tmp_path):
    from stages.common.contract.errors import disk_full

    named = disk_full(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "a.bin")), tmp_path)
    assert str(named).startswith(f"{tmp_path / 'a.bin'}: no space left on device (fix: free space on that ")
    unnamed = disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
                        tmp_path)
    assert str(unnamed).startswith(f"{tmp_path}: no space left on device (fix: ")
    quota = disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert str(quota).startswith(f"{tmp_path}: disk quota exceeded (fix: ")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("basic_ios::clear: iostream error")  # torch's writer, raised while handling it
    except RuntimeError as wrapped:
        assert str(disk_full(wrapped, tmp_path)).startswith(f"{tmp_path}: no space left on device")
    assert disk_full(ValueError("shapes differ"), tmp_path) is None  # a disk with room: a crash stays a crash


@pytest.fixture
def nearly_full_disks(monkeypatch):
    """Every filesystem reports 1 KiB free of 1 GiB (a disk that is full, for the checks that ask)."""
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30 - 1024, 1024))


def test_a_full_disk_is_said_only_for_want_of_space(tmp_path, nearly_full_disks):
    """An error with no errno counts on a (nearly) full filesystem where the folder, or the one it is made in, is;
    any other errno (a missing folder, a filesystem that refuses it) is never a full disk, full or not."""
    from stages.common.contract.errors import disk_full

    iostream = RuntimeError("basic_ios::clear: iostream error")
    assert str(disk_full(iostream, tmp_path)).startswith(f"{tmp_path}: no space left on device")
    assert str(disk_full(iostream, tmp_path / "out")).startswith(f"{tmp_path / 'out'}: no space left on device")
    assert disk_full(iostream, tmp_path / "gone" / "out") is None  # neither it nor its folder is there
    missing = OSError(errno.ENOENT, "No such file or directory", "/proc/regraft")
    assert disk_full(missing, Path("/proc/regraft")) is None
    read_only = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "a.bin"))
    assert disk_full(read_only, tmp_path) is None


def test_a_filesystem_of_no_size_is_never_full(tmp_path):
    from stages.common.contract.errors import check_room, disk_full, nearly_full

    assert not nearly_full(Path("/proc/regraft")) and not nearly_full(Path("/sys"))
    check_room(Path("/proc/regraft"))  # no refusal: writing there fails on its own, with its own line
    assert disk_full(RuntimeError("iostream error"), Path("/proc")) is None


def test_a_stage_that_fills_the_disk_leaves_the_line_and_raises_it(tmp_path, capsys):
    from pipelines.core.jobs import STAGE_ERROR, reported_error, reporting_failure
    from stages.common.contract.errors import RegraftError

    with pytest.raises(RegraftError) as raised:
        with reporting_failure("features", tmp_path / "out"):
            sys.stderr.write("features:  40%|####      | 2/5")  # a progress bar, the cursor left mid-line
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(raised.value).startswith(f"{tmp_path / 'out'}: no space left on device (fix: ")
    log = tmp_path / "job.err"
    log.write_text(capsys.readouterr().err)
    assert reported_error(log) == str(raised.value) and STAGE_ERROR in log.read_text()


def test_the_error_handler_says_its_line_when_it_cannot_write_its_log(tmp_path):
    from rich.console import Console

    from pipelines.regraft import report_and_exit

    unwritable = tmp_path / "file" / "run"  # under a file: no folder can be made there
    (tmp_path / "file").write_text("")
    for error, says in ((ValueError("a bug"), "error: regraft crashed: ValueError: a bug (a bug: its traceback "
                                                "could not be written"),
                        (OSError(errno.ENOSPC, "No space left on device"), f"error: {unwritable}: no space left "
                                                                           "on device (fix: ")):
        console = Console(record=True, width=400)
        with pytest.raises(SystemExit) as ended:
            report_and_exit(error, console, unwritable)
        lines = console.export_text().strip().splitlines()
        assert ended.value.code == 1 and len(lines) == 1 and lines[0].startswith(says), lines
