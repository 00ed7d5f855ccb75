"""Batches read ahead of the trainer: a thread takes the next `window` micro-batches while the trainer works on
the current one, so a row source that computes its rows (a vLLM server's states, online) is waited for only when
it is slower than a training step. At most `window` batches wait (and one more is being read) besides the trainer's
own; none past the run's last step is asked for (micro_batches' `stop`), and what was read ahead and not trained
on when the loop stops is dropped (a resumed run starts at its next untrained batch and asks for it again)."""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator, TypeVar

Item = TypeVar("Item")
_END = object()


class Prefetched:
    """Iterate `source` through a bounded queue filled by one daemon thread; its errors re-raised here."""

    def __init__(self, source: Iterator[Item], window: int):
        self.source, self.window = source, window
        self.waited_s = 0.0  # how long the trainer waited for a batch: the source's share of the wall time
        self.queue: queue.Queue = queue.Queue(maxsize=max(window, 1))
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.fill, name="prefetch", daemon=True)
        self.thread.start()

    def fill(self) -> None:
        try:
            for item in self.source:
                if not self.put(item):
                    return
            self.put(_END)
        except BaseException as error:  # noqa: BLE001  (handed to the trainer, which raises it)
            self.put(error)

    def put(self, item: object) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Item]:
        try:
            while True:
                started = time.perf_counter()
                item = self.queue.get()
                self.waited_s += time.perf_counter() - started
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stopping.set()


def read_ahead(source: Iterator[Item], window: int, waits: list[float] | None = None) -> Iterator[Item]:
    """`source` as it is (window 0), or read `window` batches ahead; the trainer's wait is appended to `waits`."""
    if window <= 0:
        yield from source
        return
    prefetched = Prefetched(source, window)
    try:
        yield from prefetched
    finally:
        if waits is not None:
            waits.append(prefetched.waited_s)
