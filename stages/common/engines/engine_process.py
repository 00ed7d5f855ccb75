"""Engine processes (an SGLang or vLLM server, a vLLM worker) and their lifecycle: each runs in its own process group
with its output in a log file, and stopping it stops the whole group (engines spawn workers of their own).
`ServerProcess` is an HTTP server's whole life: started, healthy (`GET /health`), stopped; or one already running."""
from __future__ import annotations

import http.client
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from stages.common.contract.errors import RegraftError

LOG_TAIL_LINES = 8
HEALTH_POLL_S = 0.2  # GET /health interval while a server starts


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process group (`start_new_session` made the leader's pid its id), SIGKILL to whatever is
    left after `grace_s`, then reap the leader."""
    group = process.pid
    signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (process.poll() is None or group_alive(group)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.poll() is None or group_alive(group):
        signal_group(group, signal.SIGKILL)
    process.wait()


def signal_group(group: int, sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def group_alive(group: int) -> bool:
    """Whether any process of the group still runs; zombies (exited, not yet reaped by init) do not count."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(group, 0)
            return True
        except ProcessLookupError:
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        if int(pgrp) == group and state != "Z":
            return True
    return False


def log_tail(path: Path) -> str:
    """The log's last non-empty lines on one line, for an error message."""
    try:
        lines = [line.strip()[:300] for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


class ServerProcess:
    """Context manager for an engine's HTTP server: start `command` (its own process group, output to `log_path`),
    wait for `GET {url}/health` to answer 200, yield; on exit stop the whole group, also after an exception. With no
    command it only checks that the server at `url` is healthy: nothing is started, nothing stopped.

    `name` ("SGLang server") and `settings` (the config prefix a fix names: `sglang`) word its errors."""

    def __init__(self, name: str, command: list[str] | None, url: str, log_path: Path, *, settings: str,
                 startup_timeout_s: float, request_timeout_s: float, stop_grace_s: float,
                 env: dict[str, str] | None = None):
        self.name, self.command, self.url, self.log_path = name, command, url.rstrip("/"), Path(log_path)
        self.settings, self.env = settings, env
        self.startup_timeout_s, self.request_timeout_s, self.stop_grace_s = \
            startup_timeout_s, request_timeout_s, stop_grace_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        if not self.command:
            if not healthy(self.url, self.request_timeout_s):
                raise RegraftError(self.url, f"no healthy {self.name} answers GET /health",
                                   f"start the server first, or unset {self.settings}.server_url to let regraft "
                                   "start one")
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
            try:
                self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True, env=self.env)
            except OSError as exc:
                raise RegraftError(self.command[0], f"cannot start the {self.name} ({exc.strerror})",
                                   f"set {self.settings}.python to an interpreter that has {self.settings} "
                                   "installed") from exc
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            self.raise_if_exited("before it became healthy")
            if healthy(self.url, min(5.0, self.startup_timeout_s)):
                return
            time.sleep(HEALTH_POLL_S)
        raise RegraftError(self.log_path, f"{self.name} not healthy after {self.startup_timeout_s:g} s "
                           f"(stopped it); log ends: {log_tail(self.log_path)}",
                           f"read the log, or raise {self.settings}.startup_timeout_s")

    def raise_if_exited(self, when: str, wait_s: float = 0.0) -> None:
        """A started server that has exited (within `wait_s`) is an error naming its log; a running one is not."""
        if self.process is None:
            return
        try:
            code = self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return
        raise RegraftError(self.log_path, f"{self.name} exited with code {code} {when}; log ends: "
                           f"{log_tail(self.log_path)}", "read the log; check the model paths and server flags")

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to whatever is left after `stop_grace_s`."""
        if self.process is not None:
            stop_group(self.process, self.stop_grace_s)
            self.process = None


def healthy(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as answer:
            return answer.status == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError):  # refused, 503 while loading, timeouts
        return False
