"""What each running stage job is doing, on the terminal, refreshed from the orchestrator's polling loop.

A stage running as a job writes its progress bar (tqdm, refreshed with \r) and its messages to its own log
(`<run>/jobs/<node>/<job id>_0_log.err` locally, `<run>/jobs/<job id>/...` on Slurm), so the terminal would show
only "dispatched" for minutes. `show` reads the last line of each running job's log and shows it under the stage's
name and time so far: on a terminal as a live area under the messages (rich Live, cleared when nothing runs), else
(a pipe, a CI log) as one plain line per running stage every `QUIET_EVERY_S` seconds.
"""
from __future__ import annotations

import atexit
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

REFRESH_S = 0.5  # a terminal's live area at most this often (each refresh reads the running jobs' log tails)
QUIET_EVERY_S = 60.0  # not a terminal: one line per running stage this often
TAIL_BYTES = 8192


def last_line(log: str | Path | None) -> str:
    """The latest line of a log: tqdm rewrites its line with \r, so the last stretch between \r or \n."""
    if not log:
        return ""
    try:
        with open(log, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - TAIL_BYTES))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    pieces = [piece.strip() for piece in tail.replace("\r", "\n").split("\n")]
    return next((piece for piece in reversed(pieces) if piece), "")


def elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class StageProgress:
    """The running stages' latest log lines: a live area on a terminal, a periodic line elsewhere."""

    def __init__(self, console: Console, quiet_every_s: float = QUIET_EVERY_S, refresh_s: float = REFRESH_S):
        self.console, self.quiet_every_s, self.refresh_s = console, quiet_every_s, refresh_s
        self.live: Live | None = None
        self.shown = 0.0  # when the live area was last redrawn
        self.said = time.monotonic()  # when the plain lines were last printed (not at the start: nothing to say yet)

    def lines(self, running: dict[str, tuple[float, str]]) -> list[tuple[str, str, str]]:
        now = time.perf_counter()
        return [(name, elapsed(now - started), last_line(log)) for name, (started, log) in running.items()]

    def update(self, running: dict[str, tuple[float, str]]) -> None:
        """`running`: node name -> (when it was dispatched, time.perf_counter(); its job's log path)."""
        if not running:
            self.stop()
            return
        now = time.monotonic()
        if not self.console.is_terminal:
            if now - self.said >= self.quiet_every_s:
                self.said = now
                for name, took, line in self.lines(running):
                    self.console.print(f"{name:>18} running {took}" + (f": {line}" if line else ""),
                                       highlight=False, markup=False, soft_wrap=True)
            return
        if self.live is not None and now - self.shown < self.refresh_s:
            return
        self.shown = now
        rows = []
        for name, took, line in self.lines(running):
            row = Text(no_wrap=True, overflow="ellipsis")
            row.append(f"{name:>18}", style="cyan")
            row.append(f" {took:>6} ")
            row.append(line or "running", style="dim")
            rows.append(row)
        if self.live is None:
            self.live = Live(Group(*rows), console=self.console, auto_refresh=False, transient=True)
            self.live.start()
        else:
            self.live.update(Group(*rows), refresh=True)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
            self.shown = 0.0


DISPLAYS: dict[int, StageProgress] = {}  # by console: the polling loop keeps no state of its own


def show(console: Console, running: dict[str, Any], launcher: Any) -> None:
    """The one call from the polling loop: `running` is the runner's node name -> Running (node, job, started);
    with nothing running the live area is cleared."""
    display = DISPLAYS.get(id(console))
    if display is None:
        if not running:
            return
        display = DISPLAYS[id(console)] = StageProgress(console)
    display.update({name: (item.started, launcher.log_of(item.job)) for name, item in running.items()})
    if not running:
        del DISPLAYS[id(console)]


@atexit.register
def stop_all() -> None:
    """A run ended by an error or a signal leaves no live area behind (and the cursor visible)."""
    for display in list(DISPLAYS.values()):
        display.stop()
    DISPLAYS.clear()
