"""One error type for bad input: its message is a single line that names the file and the fix.

A full disk is one too (`disk_full`): whatever was being written when the filesystem filled, the run ends with
`<path>: no space left on device (fix: ...)`, not with the traceback of the write that failed.
"""
from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path
from typing import Iterator


class RegraftError(Exception):
    """Bad input or state the user can fix. The CLI prints it as one line and exits non-zero."""

    def __init__(self, path: str | Path | None, problem: str, fix: str | None = None):
        self.path = None if path is None else str(path)
        self.problem = problem
        self.fix = fix
        where = f"{self.path}: " if self.path else ""
        tail = f" (fix: {fix})" if fix else ""
        super().__init__(f"{where}{problem}{tail}")


DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# how writers that raise no OSError say the same: safetensors (Rust's `os error 28`), SQLite (an MLflow store), a
# job's own report
DISK_FULL_WORDS = {"no space left on device": errno.ENOSPC, "os error 28": errno.ENOSPC,
                   "database or disk is full": errno.ENOSPC, "disk quota exceeded": errno.EDQUOT,
                   "os error 122": errno.EDQUOT}
DISK_FULL_FIX = ("free space on that filesystem, or point paths.outputs= (or paths.cache=) at a disk with room; "
                 "the same command then resumes from the complete stages")
# Below this a crash of a write is taken for a full disk: torch's writers say only `iostream error`/`unexpected pos`.
NEARLY_FULL_BYTES = 1 << 20


def disk_full(exc: BaseException, folder: str | Path | None) -> RegraftError | None:
    """`exc` as the full-disk line when a write failed for want of space or quota anywhere in its chain (the path:
    the OSError's file when it names one, else `folder`, the one being written); None for any other error.
    An exception that names no errno at all counts when `folder` (or the folder it is made in) exists on a
    filesystem that is (nearly) full now; one with another errno (a missing folder, a read-only one) never does."""
    if isinstance(exc, RegraftError) and said_disk_full(str(exc)):
        return exc  # a stage's own full-disk line, already naming its path
    for link in chain_of(exc):
        number = full_errno(link)
        if number is not None:
            path = link.filename if isinstance(link, OSError) and link.filename else folder
            return RegraftError(path, DISK_FULL[number], DISK_FULL_FIX)
    if isinstance(exc, RegraftError) or any(errno_of(link) for link in chain_of(exc)) or folder is None:
        return None
    written = next((path for path in (Path(folder), Path(folder).parent) if path.is_dir()), None)
    return RegraftError(folder, DISK_FULL[errno.ENOSPC], DISK_FULL_FIX) if written and nearly_full(written) else None


def said_disk_full(line: str) -> bool:
    """A line `disk_full` wrote: `<path>: no space left on device (fix: ...)`."""
    return any(f": {problem} (fix: " in line for problem in DISK_FULL.values())


def chain_of(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what it was raised from or while handling, each once."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def full_errno(exc: BaseException) -> int | None:
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:
        return exc.errno
    text = str(exc).lower()
    return next((number for words, number in DISK_FULL_WORDS.items() if words in text), None)


def errno_of(exc: BaseException) -> int | None:
    """The errno an OSError names (None for one without, and for any other exception)."""
    return exc.errno if isinstance(exc, OSError) else None


def nearly_full(folder: Path) -> bool:
    """Whether the filesystem of `folder` (or of its nearest existing parent) has almost nothing left for us. A
    filesystem of no size at all (/proc, /sys) holds no files of ours, full or not: never counted as full."""
    existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    try:
        usage = shutil.disk_usage(existing) if existing is not None else None
    except OSError:
        return False
    return usage is not None and usage.total > 0 and usage.free < NEARLY_FULL_BYTES


def check_room(folder: Path) -> None:
    """Refuse to start writing on a filesystem that is (nearly) full: its first write would fail."""
    if nearly_full(folder):
        raise RegraftError(folder, DISK_FULL[errno.ENOSPC], DISK_FULL_FIX)


@contextlib.contextmanager
def naming_full_disk(path: str | Path) -> Iterator[None]:
    """A write to `path` that fills the disk raises the full-disk line naming it."""
    try:
        yield
    except Exception as exc:
        full = disk_full(exc, path)
        if full is None:
            raise
        raise full from exc
