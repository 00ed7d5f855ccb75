"""The store's outbox: every MLflow write of a process is a record sent in order from one thread, so dispatching a
stage never waits on the store; what a store that stopped answering did not take is kept in a file and sent later.

- One Outbox per store (tracking.uri) per process; each Tracker is one letter in it: its records, and the ids the
  store gave its runs' handles. Calls to an http store time out after `tracking.timeout_s` with `tracking.retries`
  retries (MLflow's own defaults retry for minutes); the first call that fails marks the store down for the rest
  of the process, and every later record goes to the letter's file in `tracking.outbox` (`<outputs>/outbox`).
- The next regraft command on that store (or `python -m pipelines.tracking.outbox <folder>`) sends each kept letter whose
  process is gone, in order, into the same runs, then closes runs that a gone process left RUNNING as KILLED
  (tag `closed_because`), and says in one line what it sent and what it closed. The command does so in the store
  beside the folder and those named by `--uri` too, with nothing kept.
- A process is known by host, pid and start time (tags `regraft.host`, `regraft.pid`, `regraft.started` on every
  run), so a reused pid is not mistaken for the owner; runs another host left are not judged from here.
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import queue
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig
from rich.console import Console

from pipelines.tracking.links import runs_link
from pipelines.tracking.store import OpenStore, StoreWriter
from stages.common.contract.artifacts import write_json_atomic
from stages.common.contract.errors import RegraftError, chain_of

OWNER_TAGS = ("regraft.host", "regraft.pid", "regraft.started")
KEPT_PATTERN = "*.json"
LETTER_SETTINGS = ("uri", "experiment", "artifact_location", "max_artifact_mb", "copy_checkpoints")  # its store's


def owner_tags(pid: int | None = None) -> dict[str, str]:
    """This process (or `pid`) as the tags every run it opens carries."""
    import psutil

    pid = os.getpid() if pid is None else pid
    return {"regraft.host": socket.gethostname(), "regraft.pid": str(pid),
            "regraft.started": f"{psutil.Process(pid).create_time():.2f}"}


def owner_gone(owner: dict[str, str]) -> bool:
    """Whether the process that owns a run or a kept letter has ended (False when it runs on another host: not
    judged from here)."""
    import psutil

    if owner.get("regraft.host") != socket.gethostname():
        return False
    try:
        started = psutil.Process(int(owner["regraft.pid"])).create_time()
    except (psutil.NoSuchProcess, KeyError, ValueError):
        return True
    return f"{started:.2f}" != owner.get("regraft.started")


# an outage is said within a line of the terminal's; longer words are cut at a word, never inside one
REASON_CHARACTERS = 300


def first_line(exc: BaseException) -> str:
    """`Type: message` on one line, in whole words. An exception that quotes the one it was raised from (MLflow's
    `API request to URL failed with exception <requests' error, which quotes urllib3's, ...>`) has that quote
    replaced by the root of the chain (`ConnectionRefusedError: [Errno 111] Connection refused`)."""
    text = line_of(exc)
    quoted = exc.__cause__ or exc.__context__
    if quoted is not None and line_of(quoted) and line_of(quoted) in text:
        root = list(chain_of(exc))[-1]
        text = text.replace(line_of(quoted), f"{type(root).__name__}: {line_of(root)}")
    said = f"{type(exc).__name__}: {text}"
    return said if len(said) <= REASON_CHARACTERS else said[:REASON_CHARACTERS].rsplit(" ", 1)[0] + " ..."


def line_of(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def outbox_dir(cfg: DictConfig) -> Path:
    return Path(cfg.get("outbox") or Path(cfg.artifact_location).parent / "outbox")


def quick_http(cfg: DictConfig) -> None:
    """MLflow's http client retries a call for about 4.5 minutes by default; a run must not wait that long. Nor
    print: against a server, MLflow writes two lines to stdout for every run it ends (and asks the server for the
    run to write them), where regraft says one line of its own."""
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(cfg.get("timeout_s", 10)))
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(int(cfg.get("retries", 1)))
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


@dataclass
class Letter:
    """One Tracker's records: how many are not yet sent or kept, what was kept, the store's ids for its handles."""

    path: Path
    owner: dict[str, str]
    ids: dict[str, str] = field(default_factory=dict)
    kept: list[dict[str, Any]] = field(default_factory=list)
    outstanding: int = 0
    unkept: str = ""  # why the letter's file could not be written, if it could not


class Outbox:
    """One store's writer thread for this process, and what it could not send (a command gets its own, or its
    store agent's, from pipelines/tracking/store_agent.py::outbox_for)."""

    opened: dict[str, Any] = {}  # this process's way to each store (outbox_for): an Outbox, or an agent's
    handles = itertools.count()

    def __init__(self, cfg: DictConfig, opened: "OpenStore | None" = None, down: str | None = None):
        """`opened`: a store an agent keeps open, shared by its outboxes (one per command it serves, and no
        catching up here: the agent does that per command); `down`: why the store is known not to answer (every
        record is kept); neither: opened here, then caught up."""
        self.cfg, self.folder = cfg, outbox_dir(cfg)
        self.down: str | None = down
        self.store = opened
        self.console = Console()
        self.records: queue.Queue = queue.Queue()
        self.changed = threading.Condition()
        self.letters: list[Letter] = []
        self.caught_up = threading.Event()
        if opened is None and down is None:
            quick_http(cfg)
            try:
                self.store = OpenStore.of(cfg)
            except RegraftError:
                raise  # a store regraft cannot use at all (not migratable): the user's to fix, said before any work
            except Exception as exc:  # noqa: BLE001 (any failure to reach the store is an outage, never the run's end)
                self.down = first_line(exc)
        threading.Thread(target=self.send, name=f"outbox {cfg.uri}", daemon=True).start()
        if self.down is None and opened is None:
            self.records.put((None, self.catch_up))
        else:
            self.caught_up.set()
        if opened is None:  # an agent's outboxes end with their commands
            atexit.register(self.close_all)

    @property
    def client(self) -> Any:
        return self.store.client if self.store else None

    @property
    def experiment_id(self) -> str:
        return self.store.experiment_id if self.store else ""

    @property
    def writer(self) -> StoreWriter:
        return self.store.writer

    def answering(self) -> bool:
        return self.down is None and self.store is not None

    def runs_link(self, sweep: str | None) -> str | None:
        """The link to the runs table (pipelines/tracking/links.py); None while the store does not answer."""
        return runs_link(self.client, self.experiment_id, self.cfg, sweep) if self.answering() else None

    def new_handle(self) -> str:
        return f"h{next(self.handles)}"

    def letter(self, owner: dict[str, str]) -> Letter:
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        letter = Letter(self.folder / f"{stamp}_{os.getpid()}_{uuid.uuid4().hex[:6]}.json", owner)
        self.letters.append(letter)
        return letter

    def put(self, letter: Letter, record: dict[str, Any]) -> None:
        with self.changed:
            letter.outstanding += 1
        self.records.put((letter, record))

    def send(self) -> None:
        """The writer thread: each record to the store in order, or, once the store is down, to its letter's file."""
        while True:
            letter, record = self.records.get()
            if record is None:
                return
            if letter is None:
                self.attempt(record)
                self.caught_up.set()
                continue
            if self.down is None:
                self.attempt(lambda: self.writer.apply(record, letter.ids))
            if self.down is not None:
                self.keep(letter, record)
            with self.changed:
                letter.outstanding -= 1
                self.changed.notify_all()

    def stop(self) -> None:
        """The writer thread ends once what is queued is sent (an agent's outbox, when its command is done)."""
        self.records.put((None, None))

    def attempt(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 (whatever the store raised: it is down for this process)
            self.down = first_line(exc)

    def keep(self, letter: Letter, record: dict[str, Any]) -> None:
        letter.kept.append(record)
        payload = {**{key: self.cfg[key] for key in LETTER_SETTINGS}, "owner": letter.owner, "error": self.down,
                   "ids": letter.ids, "records": letter.kept}
        try:
            letter.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(letter.path, payload)
        except OSError as exc:  # nowhere to keep it either (a full disk): the run says so when it ends
            letter.unkept = first_line(exc)

    def close(self, letter: Letter) -> None:
        """Wait until every record of the letter is sent or kept (bounded by the http timeouts), and say in one line
        what was kept and how it will be sent."""
        self.wait(letter)
        print_tracking_line(self.console, self.closing_words(letter))

    def wait(self, letter: Letter) -> None:
        with self.changed:
            self.changed.wait_for(lambda: letter.outstanding == 0)

    def closing_words(self, letter: Letter) -> str | None:
        """What a sent letter leaves to say: what the store did not take and where it waits; None when it took all."""
        if letter.unkept:
            return (f"{self.cfg.uri} stopped answering ({self.down}) and {letter.path} could not keep what it did "
                    f"not take ({letter.unkept}); every figure is in this run's stage outputs, and the same command "
                    "run again logs them as cache hits")
        if letter.kept:
            return (f"{self.cfg.uri} stopped answering ({self.down}); {len(letter.kept)} updates of this run are kept "
                    f"in {letter.path} and go to MLflow with the next regraft command, or now with "
                    f"`python -m pipelines.tracking.outbox {self.folder}`")
        return None

    def close_all(self) -> None:
        for letter in self.letters:
            if letter.outstanding:
                self.close(letter)

    # --- catching up: kept letters of gone processes, then runs they left RUNNING --------------------------------

    def catch_up(self) -> None:
        for words in catch_up_store(self.store, self.cfg):
            print_tracking_line(self.console, words)


def print_tracking_line(console: Console, words: str | None) -> None:
    if words:
        console.print(f"[yellow]tracking:[/yellow] {words}", highlight=False, soft_wrap=True)


def catch_up_store(store: OpenStore, cfg: DictConfig) -> list[str]:
    """What gone processes left: their kept letters sent, their RUNNING runs closed; a line for each that happened."""
    sent = send_kept(outbox_dir(cfg), store.writer, cfg)
    closed = close_orphans(store.client, store.experiment_id)
    return [words for count, words in (
        (sent, f"sent {sent} updates that an outage had kept in {outbox_dir(cfg)}"),
        (closed, f"closed {closed} runs left RUNNING by regraft processes that are gone (status KILLED, tag "
                 "closed_because)")) if count]


def send_kept(folder: Path, writer: StoreWriter, cfg: DictConfig) -> int:
    """Every kept letter for this store whose process is gone, sent in order; a letter that fails again keeps what is
    left of it. The number of records sent."""
    from filelock import FileLock

    sent = 0
    for path in sorted(folder.glob(KEPT_PATTERN)):
        with FileLock(str(path) + ".lock"):  # two commands catching up at once send a letter once
            if not path.exists():
                continue
            kept = json.loads(path.read_text())
            if (kept["uri"], kept["experiment"]) != (cfg.uri, cfg.experiment) or not owner_gone(kept["owner"]):
                continue
            while kept["records"]:
                writer.apply(kept["records"][0], kept["ids"])  # raises while the store is still down
                kept["records"].pop(0)
                sent += 1
                write_json_atomic(path, kept)
            path.unlink()
        Path(str(path) + ".lock").unlink(missing_ok=True)
    return sent


def close_orphans(client: Any, experiment_id: str) -> int:
    """Runs this host's regraft processes opened and left RUNNING when they ended (kill -9, a crash): KILLED."""
    host = socket.gethostname()
    runs = client.search_runs([experiment_id], f"attributes.status = 'RUNNING' and tags.`regraft.host` = '{host}'",
                              max_results=5000)
    closed = 0
    for run in runs:
        owner = {key: run.data.tags.get(key, "") for key in OWNER_TAGS}
        if not owner_gone(owner):
            continue
        tags = {"closed_because": f"its regraft process (pid {owner['regraft.pid']} on {host}) was gone when a "
                                  f"later regraft command looked at {time.strftime('%Y-%m-%d %H:%M:%S')}"}
        if run.data.tags.get("cache_hit") == "pending":
            tags["cache_hit"] = "false"
        for key, value in tags.items():
            client.set_tag(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id, "KILLED")
        closed += 1
    return closed


def main(argv: list[str]) -> int:
    """`python -m pipelines.tracking.outbox [folder] [--uri URI]`: send every kept letter in the folder (default
    outputs/outbox) whose process is gone, each to its own store, and close the runs gone processes left RUNNING
    in those stores, in the store beside the folder (`<folder>/../mlflow.db`, the default) and in `--uri`'s: one
    line per store. Exit 1 while a store does not answer."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.tracking.outbox", description=main.__doc__)
    parser.add_argument("folder", nargs="?", default="outputs/outbox", type=Path)
    parser.add_argument("--uri", action="append", default=[], help="another store to close orphaned runs in")
    parser.add_argument("--experiment", default="regraft", help="the experiment of the --uri stores")
    args = parser.parse_args(argv)
    stores = stores_of(args.folder, args.uri, args.experiment)
    if not stores:
        print(f"tracking: nothing kept in {args.folder}, and no store beside it (mlflow.db) or given (--uri) to close "
              "runs in")
        return 0
    status = 0
    for settings in stores.values():
        words, down = replay(settings, args.folder)
        if down is not None:
            words = [f"{settings['uri']} still does not answer ({down}); its letters stay in {args.folder}"]
            status = 1
        for line in words or [f"{settings['uri']}: nothing kept in {args.folder} to send, and no run left RUNNING "
                              "by a regraft process that is gone"]:
            print(f"tracking: {line}")
    return status


def stores_of(folder: Path, uris: list[str], experiment: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The stores to catch up, by (uri, experiment): each kept letter's, the sqlite store beside the folder when
    there is one, and those given; each with the settings a letter keeps."""
    stores = {}
    for path in sorted(folder.glob(KEPT_PATTERN)):
        kept = json.loads(path.read_text())
        stores[(kept["uri"], kept["experiment"])] = {key: kept[key] for key in LETTER_SETTINGS}
    beside = folder.absolute().parent / "mlflow.db"
    for uri in uris + ([f"sqlite:///{beside}"] if beside.is_file() else []):
        stores.setdefault((uri, experiment), {"uri": uri, "experiment": experiment, "max_artifact_mb": 20.0,
                                              "artifact_location": str(folder.absolute().parent / "mlartifacts"),
                                              "copy_checkpoints": False})
    return stores


def replay(settings: dict[str, Any], folder: Path) -> tuple[list[str], str | None]:
    """One store caught up (pipelines/tracking/outbox.py catch_up_store): what it did, or why the store did not answer."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({**settings, "outbox": str(folder)})
    quick_http(cfg)
    try:
        return catch_up_store(OpenStore.of(cfg), cfg), None
    except RegraftError:
        raise
    except Exception as exc:  # noqa: BLE001 (whatever the store raised: it is still down)
        return [], first_line(exc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
