"""Locks left by a killed op build. torch JIT-builds an extension (DeepSpeed's shared-memory all-reduce on the CPU,
its fused optimizers on a GPU) under a lock file, `<extensions dir>/<op>/lock`, and takes that lock at every load,
even of a build that is done; a build killed partway (Ctrl-C, a job's time limit, an OOM kill) leaves the file, and
torch's FileBaton then waits on it forever. The file names no process, so its age is all there is to judge by."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# Longer than any build takes: the CPU shm op builds in 35-70 s on 2 cores (more under load), DeepSpeed's CUDA
# ops in a few minutes each. A lock this old belongs to a build that is no longer running.
STALE_AFTER_S = 20 * 60.0
POLL_S = 1.0


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR (regraft sets it to the venv's on the CPU), else torch's
    default (~/.cache/torch_extensions, one folder per Python/CUDA pair under it)."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_locks(root: Path) -> list[Path]:
    return sorted([*root.glob("*/lock"), *root.glob("*/*/lock")])


def age_s(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None  # released meanwhile


def take_over_stale_build_locks(root: Path | None = None, stale_after_s: float = STALE_AFTER_S,
                                poll_s: float = POLL_S) -> list[str]:
    """Wait while a lock is younger than any build takes (another rank or job may be building right now); remove
    one that is older, or that grows older while waited on, so the next load builds or loads the op again. Returns
    one line per lock taken over (also said in the stage's log)."""
    taken = []
    for lock in build_locks(root or extensions_root()):
        while (age := age_s(lock)) is not None and age < stale_after_s:
            time.sleep(poll_s)
        if age is None:
            continue
        lock.unlink(missing_ok=True)
        line = (f"took over {lock}: left {age / 60:.0f} min ago by an op build that was killed partway (no build "
                f"takes {stale_after_s / 60:.0f} min); torch would have waited on it forever")
        print(f"finetune: {line}", file=sys.stderr, flush=True)
        taken.append(line)
    return taken
