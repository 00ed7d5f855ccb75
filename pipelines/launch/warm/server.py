"""A warm interpreter for local stage jobs: torch, transformers and the stages imported once, a fork per job.

A stage job's own process spends ~4 s of a 2-core machine importing torch before it does any work, which made
running a stage as a job cost 5-7 s more than running it inline. With `launcher.warm=true` (the default) the
local launcher starts this server once per regraft process; it imports the modules the stages need and then
forks one child per job. Each child is already past the imports and starts the job in milliseconds.

submitit's local executor still runs every job, unchanged: its controller starts `<python> -u -m
submitit.core._submit <folder>`, where <python> is `python -S pipelines/launch/warm/client.py <socket>` (see there).
The server receives the job's argv, environment, working directory and stdin/stdout/stderr, forks, and the
child becomes the job; the server sends back the child's pid and, when the child ends, its exit status. If the
client goes away (the controller killed it), the server stops the child. The server stops when the process
that started it does, and takes its running children with it.

Forking after `import torch` is safe because the server never runs a torch op: the intra-op thread pool starts
lazily, in the child. What a child must not inherit is reset before the job starts: signal handlers, the
environment, the working directory, the standard streams, torch's thread count (read from OMP_NUM_THREADS
at import, so set again from the job's environment).
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import selectors
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.launch.warm.client import FORWARDED

CLIENT = Path(__file__).with_name("client.py")
BASE_MODULES = ("torch", "transformers", "submitit.core.submission", "pipelines.core.jobs")
REQUEST_TIMEOUT_S = 10.0  # a client sends its whole request at once, right after connecting
KILL_GRACE_S = 10.0  # a child whose client is gone is killed; SIGKILL again if it is still there after this long


# ---------------------------------------------------------------- the server process


@dataclass
class Child:
    connection: socket.socket
    terminated_at: float | None = None  # when its client went away and it was sent SIGTERM


@dataclass
class Server:
    listener: socket.socket
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    children: dict[int, Child] = field(default_factory=dict)

    def accept(self) -> None:
        connection, _ = self.listener.accept()
        connection.settimeout(REQUEST_TIMEOUT_S)  # a client that connects and never sends cannot stall the server
        try:
            request, fds = receive(connection)
            connection.settimeout(None)
        except (OSError, ValueError):
            connection.close()
            return
        sys.stdout.flush(), sys.stderr.flush()
        # The client sends the job's signals on once it has the pid, which may be before the child has run at all;
        # python's fork drops a signal that lands then (it clears pending ones in the child). Blocked, it waits in
        # the kernel until the child has its own handlers (run_job unblocks).
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        pid = os.fork()
        if pid == 0:  # the child never returns into the server's loop, whatever happens
            code = 1
            try:
                self.close_in_child(connection)
                code = run_job(request, fds, unblocked)
            finally:
                exit_child(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        for fd in fds:
            os.close(fd)
        try:
            connection.sendall(f"pid {pid}\n".encode())
        except OSError:  # the client is gone already: the child is stopped at the next look
            pass
        self.children[pid] = Child(connection)
        self.selector.register(connection, selectors.EVENT_READ, pid)

    def close_in_child(self, own: socket.socket) -> None:
        self.selector.close()
        self.listener.close()
        for child in self.children.values():
            child.connection.close()
        own.close()

    def client_gone(self, pid: int) -> None:
        """The client closed its end before the child ended: it was killed, so the job is killed too. Not asked
        with SIGTERM: submitit's job wrapper ignores it (only a stage's own handler, a fine-tune's, acts on it),
        and whoever killed the client (regraft's cancel, submitit's controller) gave the job its signals first."""
        child = self.children[pid]
        self.selector.unregister(child.connection)
        if child.terminated_at is None:
            signal_child(pid, signal.SIGKILL)
            child.terminated_at = time.monotonic()

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
            child = self.children.pop(pid, None)
            if child is None:
                continue
            if child.terminated_at is None:
                self.selector.unregister(child.connection)
                try:
                    child.connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
            child.connection.close()
        for pid, child in self.children.items():
            if child.terminated_at is not None and time.monotonic() - child.terminated_at > KILL_GRACE_S:
                signal_child(pid, signal.SIGKILL)

    def serve(self, parent: int) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        while os.getppid() == parent:
            for key, _ in self.selector.select(timeout=0.05):
                if key.data is None:
                    self.accept()
                elif not receive_quietly(key.fileobj):
                    self.client_gone(key.data)
            self.reap()

    def stop_children(self) -> None:
        for pid in self.children:
            signal_child(pid, signal.SIGTERM)


def receive_quietly(connection: socket.socket) -> bytes:
    """A byte from a client, b"" once it has closed its end (a client sends nothing after its request)."""
    try:
        return connection.recv(1)
    except OSError:
        return b""


def signal_child(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """A job request: an 8-byte length sent with the client's three standard fds, then that much JSON."""
    header, fds, _, _ = socket.recv_fds(connection, 8, 3)
    if len(header) != 8 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request without its header or its three standard streams")
    size, payload = struct.unpack("!Q", header)[0], b""
    while len(payload) < size:
        chunk = connection.recv(size - len(payload))
        if not chunk:
            raise ValueError("a request cut short")
        payload += chunk
    return json.loads(payload), fds


def run_job(request: dict, fds: list[int], signal_mask: set[signal.Signals]) -> int:
    """In the forked child: become the job `python [-u] -m MODULE ARGS...` and return its exit status. Signals
    stay blocked until the job's own handlers are set and `signal_mask` (the server's) is back, inside the job."""
    reset_signals(request.get("ignored_signals", []))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # as `python -u`
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    code = 0
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, signal_mask)  # one that came meanwhile is delivered here
        module, arguments = module_command(request["argv"])
        sys.argv = [module, *arguments]
        sys.path[0] = request["cwd"]  # what `python -m` puts first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # python ends an uncaught SIGINT as killed by SIGINT
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001  (the job's own failure, reported as python reports it)
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    return code


def reset_signals(ignored: list[int]) -> None:
    """The signal handlers a plain `python` started by the client would have: what the client was started
    ignoring stays ignored (a job started with SIGINT ignored keeps ignoring Ctrl-C), the rest as python sets them."""
    for number in FORWARDED:
        if number in ignored:
            signal.signal(number, signal.SIG_IGN)
        else:
            signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)


def exit_child(code: int) -> None:
    """End the forked child as python ends: wait for the job's non-daemon threads, run the exit handlers, exit
    with `code` (a negative one: the signal python would have died of). Never returns to the server's loop."""
    with contextlib.suppress(BaseException):
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)


def module_command(argv: list[str]) -> tuple[str, list[str]]:
    """`-u -m MODULE ARGS...` -> (MODULE, ARGS); the only shape a warm job takes (the client checks it first)."""
    options = argv[:argv.index("-m")]
    if any(option != "-u" for option in options):
        raise ValueError(f"a warm job runs `python [-u] -m MODULE ...`, not {shlex.join(argv)}")
    return argv[len(options) + 1], argv[len(options) + 2:]


def serve(path: str, modules: list[str]) -> None:
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)  # clients queue here while the imports below run
    started = time.perf_counter()
    for name in (*BASE_MODULES, *modules):
        importlib.import_module(name)
    print(f"warm interpreter: {len(modules) + len(BASE_MODULES)} modules imported in "
          f"{time.perf_counter() - started:.1f} s; serving {path}", flush=True)
    server = Server(listener)
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(0))
    try:
        server.serve(parent)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop_children()
        Path(path).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the folder WarmInterpreter made for the socket, if nothing else is there
            Path(path).parent.rmdir()


# ---------------------------------------------------------------- the launcher's side


class WarmInterpreter:
    """The server as the local launcher sees it: started once, asked for the `python` of a job, stopped at exit."""

    def __init__(self, modules: list[str], log: Path):
        # mkdtemp's folder is the user's alone (0700): nobody else may hand this server a job to run
        self.folder = Path(tempfile.mkdtemp(prefix="regraft-warm-"))  # short: a socket path has ~100 bytes
        self.socket = self.folder / "socket"
        self.modules = sorted(modules)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as output:
            self.process = subprocess.Popen([sys.executable, "-m", "pipelines.launch.warm.server", str(self.socket),
                                             *self.modules],
                                            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10.0
        while not self.socket.exists() and self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def alive(self) -> bool:
        return self.process.poll() is None

    def covers(self, modules: list[str]) -> bool:
        return self.alive() and set(modules) <= set(self.modules)

    def python(self) -> str:
        """The interpreter command for submitit's local executor: the client if the server is up, else plain."""
        if not self.alive():
            return shlex.quote(sys.executable)
        return shlex.join([sys.executable, "-S", str(CLIENT), str(self.socket)])

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_shared: WarmInterpreter | None = None


def shared_interpreter(modules: list[str], log: Path) -> WarmInterpreter:
    """One server per regraft process, kept across the members of a sweep; restarted if it cannot serve them."""
    global _shared
    if _shared is None or not _shared.covers(modules):
        if _shared is not None:
            _shared.stop()
        else:
            atexit.register(lambda: _shared is not None and _shared.stop())
        _shared = WarmInterpreter(modules, log)
    return _shared


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
