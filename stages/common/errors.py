"""One error type for bad input: its message is a single line that names the file and the fix."""
from __future__ import annotations

from pathlib import Path


class RegraftError(Exception):
    """Bad input or state the user can fix. The CLI prints it as one line and exits non-zero."""

    def __init__(self, path: str | Path | None, problem: str, fix: str | None = None):
        self.path = None if path is None else str(path)
        self.problem = problem
        self.fix = fix
        where = f"{self.path}: " if self.path else ""
        tail = f" (fix: {fix})" if fix else ""
        super().__init__(f"{where}{problem}{tail}")
