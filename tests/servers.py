"""Servers the tests talk to: a real `vllm.entrypoints.openai.api_server` from the engine venv (its command,
environment and lifecycle, written once for test_regenerate and test_api_keys), and the reply of the small
stand-ins they put in front of or in place of one."""
from __future__ import annotations

import contextlib
import os
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Iterator

import pytest

from stages.common.engines.engine_process import ServerProcess
from stages.common.contract.runtime import free_port
from stages.common.engines.vllm_engine import VllmConfig, engine_available

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MAX_MODEL_LEN = 256  # the server's and the offline engine's, so a long prompt is refused by both
NO_ENGINE = "engine: runs vLLM from .venv-vllm, which is missing (make venv-vllm)"


def needs_engine(test):
    """slow and engine, and skipped with the reason where the engine venv is missing."""
    for mark in (pytest.mark.slow, pytest.mark.engine, pytest.mark.skipif(not engine_available(), reason=NO_ENGINE)):
        test = mark(test)
    return test


@contextlib.contextmanager
def vllm_server(model: Path, log: Path, *extra: str) -> Iterator[str]:
    """The server on `model` (float32, eager, MAX_MODEL_LEN) with `extra` flags; yields its URL, stops it after."""
    if not engine_available():
        pytest.skip(NO_ENGINE)
    port = free_port(HOST)
    command = [str(REPO / VllmConfig().python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.1",
               "--max-model-len", str(MAX_MODEL_LEN), "--host", HOST, "--port", str(port), *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with ServerProcess("vLLM server", command, f"http://{HOST}:{port}", log, settings="vllm",
                       startup_timeout_s=600, request_timeout_s=30, stop_grace_s=10, env=env) as server:
        yield server.url


def reply(handler: BaseHTTPRequestHandler, status: int, payload: bytes, **headers: str) -> None:
    """A stand-in's JSON answer: status, type, length, any `headers` (`Location=...`), the body."""
    handler.send_response(status)
    for name, value in {"Content-Type": "application/json", **headers, "Content-Length": str(len(payload))}.items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(payload)
