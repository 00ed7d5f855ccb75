"""Process-level helpers every stage shares: a free local port, and torch's intra-op threads for a while."""
from __future__ import annotations

import contextlib
import socket
from typing import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (a rendezvous, a server); the OS picks it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """`count` intra-op threads inside the block (None or 0: torch's setting), restored afterwards."""
    import torch  # here, so that free_port stays importable without torch (the SGLang client)

    before = torch.get_num_threads()
    if count and count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
