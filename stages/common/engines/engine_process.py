"""Engine processes (an SGLang or vLLM server, a vLLM worker) and their lifecycle: each runs in its own process group
with its output in a log file, and stopping it stops the whole group (engines spawn workers of their own).
`ServerProcess` is an HTTP server's whole life: started, healthy (`GET /health`), stopped; or one already running."""
from __future__ import annotations

import http.client
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from stages.common.contract.errors import RegraftError

HOST = "127.0.0.1"  # where regraft starts a server for its own requests
LOG_TAIL_LINES = 8
HEALTH_POLL_S = 0.2  # GET /health interval while a server starts
# An engine's start besides reading its weights (imports, the memory profile, CUDA graphs, compilation) gets
# START_FLOOR_S; its weights get their bytes at LOAD_BYTES_PER_S, a network file system's rate (local NVMe reads
# 2-5 GB/s): too long a timeout only reports a hung start later, too short a one kills a healthy start.
START_FLOOR_S = 900.0
LOAD_BYTES_PER_S = 0.5e9


def start_timeout(given: float | None, *models: str | Path | None) -> float:
    """How long an engine may take to start on `models` (a target, a drafter): `given`, or START_FLOOR_S plus their
    safetensors bytes at LOAD_BYTES_PER_S (Kimi-K2.5's ~595 GB: 900 + 1190 s, where a flat 900 s would kill it)."""
    if given is not None:
        return given
    return START_FLOOR_S + sum(checkpoint_bytes(model) for model in models if model) / LOAD_BYTES_PER_S


def checkpoint_bytes(folder: str | Path) -> int:
    """The bytes of a model folder's safetensors files (0 for what is no folder: a hub name, a missing path)."""
    return sum(path.stat().st_size for path in Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else 0


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


def interpreter_found(python: str) -> bool:
    """A path that exists, or a bare name on PATH (`python`)."""
    return Path(python).exists() if "/" in python else shutil.which(python) is not None


def on_this_machine(url: str) -> bool:
    """Whether `url`'s host is this machine: a loopback or wildcard address, this host's name, or a name that
    resolves to one of those or to this host's own address (a name that does not resolve is not this machine)."""
    host = urlparse(url).hostname or ""
    if host in ("localhost", "0.0.0.0", "::", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
        own = socket.gethostbyname_ex(socket.gethostname())[2]
    except (OSError, ValueError):
        return False
    return address.is_loopback or str(address) in own
