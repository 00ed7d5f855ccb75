"""A store agent: one process per MLflow store that keeps mlflow imported and the store open between regraft commands.

Opening a store costs a command about 7 s on 2 cores (importing mlflow ~4 s, the SqlAlchemy store's start and its
schema check ~3 s) while a rerun of cache hits needs about 2 s for everything else. With `tracking.agent=true` (the
default for a store on this machine: `wants_agent`) the first command on a store starts this agent, detached, and
every command after it hands its records to the agent over a unix socket: the store is opened and checked once per agent, and the agent is per store version
(its socket's name hashes the store's settings, this code and mlflow's version, so a change starts a new one).

- A command's Tracker is one connection: its records go in order to the agent, which applies them from a thread of
  its own (one per command, as each command's outbox had one), and `close` answers when they are all sent or kept,
  with the store's run ids and the line a command prints when the store stopped answering. The command's output
  is what it was without the agent; only the seconds differ.
- What gone processes left (kept letters, runs left RUNNING) is caught up once per command.
- A store that stops answering: the command's records are kept in its letter (pipelines/tracking/outbox.py); the
  agent then takes no new command and ends when its commands do, so the next command starts a fresh one.
- The agent ends after `tracking.agent_idle_s` without a command, or when its socket is taken from it; its log is
  `<socket>.log` in `agent_folder()`. When no agent can be reached, a command opens the store itself.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from pipelines.tracking.links import runs_link
from pipelines.tracking.outbox import Letter, Outbox, catch_up_store, first_line, outbox_dir, quick_http, print_tracking_line
from pipelines.tracking.store import OpenStore, sqlite_file

ROOT = Path(__file__).resolve().parents[2]
# the code whose change makes an agent stale: what it runs for a command
AGENT_CODE = tuple(f"pipelines/tracking/{name}.py" for name in ("store_agent", "outbox", "store", "tracker"))
SETTINGS_ENV = "REGRAFT_STORE_AGENT"  # the agent's settings (never its argv: `ps` shows no store paths)
# set by regraft itself (pipelines/tracking/outbox.py quick_http): from tracking.timeout_s and .retries, which the settings
# hold already, and MLflow's printing, always off
QUICK_HTTP_ENV = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                  "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")
START_TIMEOUT_S = 30.0  # for a new agent to listen
OPEN_TIMEOUT_S = 600.0  # for it to open the store (a first migration, an http store's retries)


def agent_folder() -> Path:
    """Where agents listen: short (a unix socket's path has at most 107 bytes) and this user's."""
    return Path(tempfile.gettempdir()) / f"regraft-agents-{os.getuid()}"


def agent_settings(cfg: DictConfig) -> dict[str, Any]:
    """What an agent needs of `tracking` (resolved): the store, where its artifacts and kept letters go, the limits."""
    keys = ("uri", "experiment", "artifact_location", "copy_checkpoints", "max_artifact_mb", "timeout_s", "retries")
    settings = {key: cfg.get(key) for key in keys}
    settings["outbox"] = str(outbox_dir(cfg).absolute())
    settings["artifact_location"] = str(Path(settings["artifact_location"]).absolute())
    database = sqlite_file(settings["uri"])
    if database is not None and not database.is_absolute():  # the agent's folder is not the command's
        settings["uri"] = settings["uri"].replace(str(database), str(database.absolute()), 1)
    return settings


def socket_path(settings: dict[str, Any]) -> Path:
    """One agent per store and code: the hash of the settings, MLflow's environment (credentials: an agent talks to
    the store as the command that started it), the agent's code, mlflow's version and the python."""
    mlflow_env = sorted((key, value) for key, value in os.environ.items()
                        if key.startswith("MLFLOW_") and key not in QUICK_HTTP_ENV)
    digest = hashlib.sha256(json.dumps([settings, mlflow_env], sort_keys=True).encode())
    for name in AGENT_CODE:
        digest.update((ROOT / name).read_bytes())
    digest.update(f"{metadata.version('mlflow')} {sys.executable}".encode())
    return agent_folder() / f"{digest.hexdigest()[:20]}.sock"


# --- the wire: one JSON object per line -----------------------------------------------------------------------------

def send(stream: BinaryIO, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def receive(stream: BinaryIO) -> dict[str, Any] | None:
    line = stream.readline()
    return json.loads(line) if line else None


def connect(path: Path, timeout_s: float | None) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(path))
    except OSError:
        connection.close()
        return None
    connection.settimeout(timeout_s)
    return connection


# --- a command's side -----------------------------------------------------------------------------------------------

class AgentOutbox:
    """What a Tracker calls on its outbox (letter, put, close, runs_link, new_handle, answering), sent to the agent."""

    def __init__(self, cfg: DictConfig, path: Path):
        from rich.console import Console

        self.cfg, self.path, self.console = cfg, path, Console()
        self.streams: dict[int, BinaryIO] = {}
        self.sending = threading.Lock()  # a Tracker may queue from more than one thread: one line at a time
        self.broken: str | None = None  # the agent went away
        self.down: str | None = None  # the store stopped answering the agent
        self.instead: Outbox | None = None  # the agent was gone before a command began: it opens the store itself
        self.handles = iter(range(1 << 62))

    @classmethod
    def reach(cls, cfg: DictConfig) -> "AgentOutbox | Outbox | None":
        """The store's agent, started if none listens, once it has the store open; an outbox here that keeps every
        record when the store does not answer; None when no agent can be reached (the caller opens the store).
        Raises RegraftError for a store regraft cannot use."""
        from stages.common.contract.errors import RegraftError

        settings = agent_settings(cfg)
        path = socket_path(settings)
        outbox = cls(cfg, path)
        for _ in range(2):  # a second try when the agent found ended just as it was reached
            if not listening(path):
                start_agent(path, settings, float(cfg.agent_idle_s))
            try:
                answer = outbox.ask({"ping": True})[1]
            except (OSError, EOFError):
                continue
            if "refused" in answer:
                raise RegraftError(None, answer["refused"])
            return Outbox(cfg, down=answer["down"]) if "down" in answer else outbox
        return None

    def new_handle(self) -> str:
        return f"h{next(self.handles)}"

    def answering(self) -> bool:
        return self.broken is None and self.down is None

    def letter(self, owner: dict[str, str]) -> Letter:
        """A command's connection: the agent answers once what gone processes left is caught up."""
        from stages.common.contract.errors import RegraftError

        if self.instead is None:
            try:
                stream, answer = self.ask({"letter": owner})
            except (OSError, EOFError):
                self.instead = Outbox(self.cfg)
        if self.instead is not None:
            return self.instead.letter(owner)
        if "path" not in answer:  # the store stopped answering since this command reached the agent
            raise RegraftError(None, answer.get("refused") or f"{self.cfg.uri} does not answer: {answer.get('down')}",
                               "start the tracking server (or set tracking.uri=), then rerun")
        letter = Letter(Path(answer["path"]), owner)
        self.streams[id(letter)] = stream
        for words in answer["notes"]:
            print_tracking_line(self.console, words)
        return letter

    def put(self, letter: Letter, record: dict[str, Any]) -> None:
        if id(letter) not in self.streams:
            return self.instead.put(letter, record)
        if self.broken is None:
            try:
                with self.sending:
                    send(self.streams[id(letter)], {"record": record})
            except OSError as exc:
                self.lost(exc)

    def close(self, letter: Letter) -> None:
        """Wait until the agent sent or kept every record of the letter; say what it kept, as a command would."""
        if id(letter) not in self.streams:
            return self.instead.close(letter)
        answer = None
        if self.broken is None:
            try:
                with self.sending:
                    send(self.streams[id(letter)], {"close": True})
                    answer = receive(self.streams[id(letter)])
            except OSError as exc:
                self.lost(exc)
        if answer is None:
            self.lost(EOFError("it closed the connection"))
            return
        letter.ids.update(answer["ids"])
        self.down = self.down or answer["down"]
        print_tracking_line(self.console, answer["words"])

    def close_all(self) -> None:
        pass  # the agent waits for what a command sent before it went away

    def runs_link(self, sweep: str | None) -> str | None:
        """The link to the runs table; None while the store does not answer (the run said so; the link can wait)."""
        if self.instead is not None:
            return self.instead.runs_link(sweep)
        if not self.answering():
            return None
        try:
            return self.ask({"link": sweep})[1].get("link")
        except (OSError, EOFError):
            return None

    def ask(self, message: dict[str, Any]) -> tuple[BinaryIO, dict[str, Any]]:
        connection = connect(self.path, OPEN_TIMEOUT_S)
        if connection is None:
            raise ConnectionError(f"no store agent listens at {self.path}")
        stream = connection.makefile("rwb")
        send(stream, message)
        answer = receive(stream)
        if answer is None:
            raise EOFError(f"the store agent at {self.path} closed the connection")
        connection.settimeout(None)  # a close waits as long as the store takes (bounded by its own timeouts)
        return stream, answer

    def lost(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = f"{type(exc).__name__}: {exc}"
            self.console.print(f"[yellow]tracking:[/yellow] the store agent of {self.cfg.uri} stopped ({self.broken}) "
                               f"(its log: {self.path}.log); this run's later updates are not in MLflow, and the same "
                               "command run again logs them as cache hits", highlight=False, soft_wrap=True)


def wants_agent(cfg: DictConfig) -> bool:
    """`tracking.agent`, or where it is null, whether the store is on this machine (a sqlite file, a folder): on a
    server's store an agent saves a rerun less than on sqlite, and the command that starts it pays more than a rerun
    saves (docs/speed.md's figures), while it stays up on every teammate's machine."""
    if "agent" not in cfg:  # a tracking config built without the schema (the outbox command's) opens the store
        return False
    chosen = cfg.agent
    if chosen is not None:
        return bool(chosen)
    uri = str(cfg.uri)
    return urlparse(uri).scheme in ("", "file", "sqlite") and not uri.startswith("databricks")  # MLflow's bare word


def outbox_for(cfg: DictConfig) -> "Outbox | AgentOutbox":
    """This process's way to the store, opened once per process: its agent where `wants_agent`, else (or when no
    agent can serve it) a writer thread here (pipelines/tracking/outbox.py)."""
    agent = wants_agent(cfg)
    key = f"{cfg.uri}\n{cfg.experiment}\n{agent}"
    if key not in Outbox.opened:
        reached = AgentOutbox.reach(cfg) if agent else None
        Outbox.opened[key] = reached or Outbox(cfg)
    return Outbox.opened[key]


def listening(path: Path) -> bool:
    connection = connect(path, 1.0)
    if connection is None:
        return False
    connection.close()
    return True


def start_agent(path: Path, settings: dict[str, Any], idle_s: float) -> None:
    """A detached agent for the store, once: commands started together take a lock, and the first one starts it."""
    from filelock import FileLock

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if listening(path):
            return
        path.unlink(missing_ok=True)  # a stale socket: its agent is gone
        env = {**os.environ, SETTINGS_ENV: json.dumps({**settings, "socket": str(path), "idle_s": idle_s}),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(str(path) + ".log", "ab") as log:
            subprocess.Popen([sys.executable, "-m", "pipelines.tracking.store_agent"], cwd=ROOT, env=env,
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not listening(path) and time.monotonic() < deadline:
            time.sleep(0.02)


def stop_agents(uri_part: str = "") -> int:
    """Ask every agent of this user whose store's uri contains `uri_part` to end; how many were asked."""
    asked = 0
    for path in sorted(agent_folder().glob("*.sock")):
        connection = connect(path, 5.0)
        if connection is None:
            continue
        with connection, connection.makefile("rwb") as stream:
            send(stream, {"stop": uri_part})
            answer = receive(stream) or {}
        asked += bool(answer.get("stopping"))
    return asked


# --- the agent's side -----------------------------------------------------------------------------------------------

class Agent:
    """Listens on its socket, opens the store once, and serves each connection from a thread of its own."""

    def __init__(self, settings: dict[str, Any]):
        self.path = Path(settings.pop("socket"))
        self.idle_s = float(settings.pop("idle_s"))
        self.cfg = OmegaConf.create(settings)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(64)
        self.listener.settimeout(1.0)
        self.inode = self.path.stat().st_ino
        self.opened = threading.Event()
        self.store: Any = None
        self.refused = self.down = None
        self.draining = False
        self.active = 0
        self.last_seen = time.monotonic()
        self.lock = threading.Lock()
        self.catching_up = threading.Lock()

    def serve(self) -> None:
        threading.Thread(target=self.open, daemon=True).start()
        log(f"serving {self.cfg.uri} at {self.path}")
        while not self.done():
            self.accept()
        if self.ours():
            self.path.unlink(missing_ok=True)  # no new command finds it; one that already connected is served
        self.listener.settimeout(0.1)
        while self.accept() or self.active:
            time.sleep(0.1)
        self.listener.close()
        log("done")

    def accept(self) -> bool:
        try:
            connection, _ = self.listener.accept()
        except TimeoutError:
            return False
        with self.lock:
            self.active += 1
        threading.Thread(target=self.serve_connection, args=(connection,), daemon=True).start()
        return True

    def done(self) -> bool:
        with self.lock:
            if self.active:
                return False
            idle = time.monotonic() - self.last_seen
        return self.draining or not self.ours() or idle > self.idle_s

    def ours(self) -> bool:
        with contextlib.suppress(OSError):
            return self.path.stat().st_ino == self.inode
        return False

    def drain(self, why: str) -> None:
        """Take no new command: the next one starts a fresh agent (a store that stopped answering, a stop)."""
        if not self.draining:
            log(f"draining: {why}")
            self.draining = True
            if self.ours():
                self.path.unlink(missing_ok=True)

    def open(self) -> None:
        from stages.common.contract.errors import RegraftError

        quick_http(self.cfg)
        try:
            self.store = OpenStore.of(self.cfg)
        except RegraftError as exc:
            self.refused = str(exc)
        except Exception as exc:  # noqa: BLE001 (a store that does not answer: the commands open it themselves)
            self.down = first_line(exc)
        if self.store is None:
            self.drain(self.refused or self.down or "")
        log(f"store opened: {self.cfg.uri}" if self.store else f"store not opened: {self.refused or self.down}")
        self.opened.set()

    def serve_connection(self, connection: socket.socket) -> None:
        message = None
        try:
            with connection, connection.makefile("rwb") as stream:
                message = receive(stream)
                if message is not None:
                    self.answer(message, stream)
        except Exception as exc:  # noqa: BLE001 (a command that went away mid-answer: its records were applied)
            log(f"connection ended: {type(exc).__name__}: {exc}")
        finally:
            with self.lock:
                self.active -= 1
                if message is not None:  # a look whether it listens (connect, close) is not a command
                    self.last_seen = time.monotonic()

    def answer(self, message: dict[str, Any], stream: BinaryIO) -> None:
        if "stop" in message:
            stopping = message["stop"] in self.cfg.uri
            if stopping:
                self.drain("asked to stop")
            send(stream, {"stopping": stopping})
            return
        self.opened.wait()
        if self.store is None:
            send(stream, {"refused": self.refused} if self.refused else {"down": self.down})
        elif "ping" in message:
            send(stream, {"ok": True})
        elif "link" in message:
            send(stream, {"link": runs_link(self.store.client, self.store.experiment_id, self.cfg, message["link"])})
        elif "letter" in message:
            self.serve_letter(message["letter"], stream)

    def serve_letter(self, owner: dict[str, str], stream: BinaryIO) -> None:
        """One command's records, applied in order from an outbox of its own, as the command would have."""
        with self.catching_up:
            notes = catch_up_store(self.store, self.cfg)
        outbox = Outbox(self.cfg, opened=self.store)
        letter = outbox.letter(owner)
        try:
            send(stream, {"path": str(letter.path), "notes": notes})
            while (message := receive(stream)) is not None:
                if "record" in message:
                    outbox.put(letter, message["record"])
                elif "close" in message:
                    outbox.wait(letter)
                    send(stream, {"ids": letter.ids, "words": outbox.closing_words(letter), "down": outbox.down})
        finally:
            outbox.wait(letter)  # a command that went away: what it sent is still sent (or kept)
            outbox.stop()
            if outbox.down is not None:
                self.drain(outbox.down)


def log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [{os.getpid()}] {line}", flush=True)


def main() -> int:
    from stages.common.contract.runtime import set_process_defaults

    set_process_defaults()
    Agent(json.loads(os.environ.pop(SETTINGS_ENV))).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
