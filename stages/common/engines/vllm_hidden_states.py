"""A hidden-states connector for vLLM on CPU (loaded by vLLM from this module path, in the engine venv only).

vLLM's `extract_hidden_states` method caches the requested layers' states of every prompt token in its KV cache,
and a connector writes them out when the request finishes. The stock `ExampleHiddenStatesConnector` copies them
to pinned host memory on a CUDA stream, which fails on a CPU build (`pin_memory=True requires a CUDA ...
backend`). Here the cache already is host memory: the same slots are gathered and written synchronously, in the
stock connector's file format (`hidden_states` [T, L, H], `token_ids` [T]) and lock protocol. On a GPU keep the
stock connector (`features.vllm_connector=stock`).
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)


class _Written:
    """Stands where the stock connector keeps a CUDA event: the write finished before it was recorded."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's wait, as the stock connector's writer thread does
        self._req_copy_events[pending.req_id] = _Written()
