"""The target's states from vLLM's `extract_hidden_states` method: from its offline engine (the features and diagnose
stages) or from a live server (online features, for fine-tunes that never read them from disk).

vLLM caches the aux layers and the last one per prompt token (speculators' way), and a hidden-states connector writes
them out when the request ends: a safetensors file of the prompt's states [T, layers, H] in the engine's dtype.
Both ways share `StateRows.batch_states`: a batch's rows (padding left out) go in as prompts of token ids, each file
is read, checked against its prompt and deleted, and the states come back padded as the features stage stores them
(zeros past a row's tokens; the final state after the target's final norm), in the engine's dtype.

- `OfflineStates`: vLLM's offline engine (`stages/common/engines/vllm_engine.py`) on a target, for as long as the
  block lasts; its log and the connector's files where the stage says.
- `EngineStates`: a `vllm serve` answering a completion of `max_tokens=1` on a prompt of token ids with
  `kv_transfer_params.hidden_states_path`; one request per row, so the server batches them. `EngineRows` is a row
  source over tokenized chats whose `take` asks for them, so a fine-tune reads the server exactly as it reads shards.
  `states_server` starts the server from the engine venv (`make venv-vllm`), or checks one already at a URL; the
  flags it starts one with (`serve_command`) are what an existing server needs too, the connector's files on a
  file system this process reads.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch

from stages.common.contract.errors import RegraftError
from stages.common.contract.runtime import free_port
from stages.common.drafter.config import INPUT_OF_LAYER, OUTPUT_OF_LAYER, convert_aux_layer_ids
from stages.common.drafter.target import FinalNorm
from stages.common.engines.engine_process import HOST, ServerProcess, start_timeout
from stages.common.engines.openai_client import request_json, served_models
from stages.common.engines.vllm_engine import (EngineFeaturesConfig, VllmConfig, VllmEngine, check_engine,
                                               server_command, server_env)

CONNECTORS = {"cpu": ("CpuHiddenStatesConnector", "stages.common.engines.vllm_hidden_states"),
              "stock": ("ExampleHiddenStatesConnector", None)}


def capture_settings(layer_ids: list[int], num_layers: int, connector: str, spill: Path) -> dict[str, dict]:
    """vLLM's `extract_hidden_states` speculative config and the connector's kv-transfer config: the aux layers
    in vLLM's convention (the state after j layers: output-of-layer i is j = i + 1) and the state after the last
    layer (j = L), each request's states written under `spill`."""
    if connector not in CONNECTORS:
        raise RegraftError(f"connector={connector}", "not a hidden-states connector", "use cpu or stock")
    name, module = CONNECTORS[connector]
    capture = convert_aux_layer_ids(layer_ids, OUTPUT_OF_LAYER, INPUT_OF_LAYER) + [num_layers]
    kv_transfer = {"kv_connector": name, "kv_role": "kv_producer",
                   "kv_connector_extra_config": {"shared_storage_path": str(spill)}}
    if module:
        kv_transfer["kv_connector_module_path"] = module
    return {"speculative": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture}}},
            "kv_transfer": kv_transfer}


def serve_command(cfg: EngineFeaturesConfig, target: str, layer_ids: list[int], max_length: int, spill: Path,
                  port: int) -> list[str]:
    """`vllm serve` on the target with the states capture on (chunked prefill off: the capture needs whole prompts)."""
    settings = capture_settings(layer_ids, FinalNorm.load(target).num_layers, cfg.connector, spill)
    return server_command(cfg.vllm, target, dtype=cfg.dtype, host=HOST, port=port,
                          max_model_len=cfg.vllm.max_model_len or max_length + 1,
                          trust_remote_code=cfg.trust_remote_code) + [
        "--no-enable-chunked-prefill", "--speculative-config", json.dumps(settings["speculative"]),
        "--kv-transfer-config", json.dumps(settings["kv_transfer"])]


@contextlib.contextmanager
def states_server(cfg: EngineFeaturesConfig, target: str, layer_ids: list[int], max_length: int,
                  work: Path) -> Iterator[str]:
    """The URL of a server that computes the target's states: `cfg.server_url`, checked, or one started here (its log
    and the connector's files under `work`) and stopped when the block ends."""
    timeout = start_timeout(cfg.vllm.startup_timeout_s, target)
    if cfg.server_url:
        with ServerProcess("vLLM server", None, cfg.server_url, work / "engine.log", settings="finetune.engine",
                           startup_timeout_s=timeout, request_timeout_s=30, stop_grace_s=cfg.vllm.stop_grace_s):
            yield cfg.server_url.rstrip("/")
        return
    check_engine(cfg.vllm, "finetune.engine.")
    port = free_port(HOST)
    command = serve_command(cfg, target, layer_ids, max_length, work / "engine_states", port)
    with ServerProcess("vLLM server", command, f"http://{HOST}:{port}", work / "engine.log",
                       settings="finetune.engine.vllm", startup_timeout_s=timeout, request_timeout_s=30,
                       stop_grace_s=cfg.vllm.stop_grace_s, env=server_env(cfg.vllm)) as server:
        yield server.url


class StateRows:
    """A batch's aux and final states from files an engine wrote (see the module docstring); `files` is the engine's."""

    def __init__(self, target: str | Path, layer_ids: list[int]):
        self.norm = FinalNorm.load(target)
        self.aux_width = len(layer_ids) * self.norm.hidden_size

    def files(self, prompts: list[list[int]]) -> list[Path]:
        raise NotImplementedError

    def batch_states(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, L, 3H] aux, [B, L, H] final) for right-padded rows, zeros past each row's tokens, in the dtype the
        engine computed them in (the final state normed in float32, then rounded to it)."""
        lengths = batch["attention_mask"].sum(-1).tolist()
        prompts = [ids[:length].tolist() for ids, length in zip(batch["input_ids"], lengths)]
        states = [read_engine_states(path, prompt) for path, prompt in zip(self.files(prompts), prompts)]
        dtype = states[0].dtype
        aux = torch.zeros(*batch["input_ids"].shape, self.aux_width, dtype=dtype)
        last = torch.zeros(*batch["input_ids"].shape, self.norm.hidden_size, dtype=dtype)
        for row, (row_states, length) in enumerate(zip(states, lengths)):
            aux[row, :length] = row_states[:, :-1].flatten(1)
            last[row, :length] = self.norm(row_states[:, -1])
        return aux, last


class OfflineStates(StateRows):
    """vLLM's offline engine on `target` with the states capture on, up for the `with` block: its log at `log_path`,
    the connector's files under `spill` (removed at the end)."""

    def __init__(self, cfg: VllmConfig, target: str | Path, layer_ids: list[int], *, connector: str, dtype: str,
                 trust_remote_code: bool, max_length: int, log_path: Path, spill: Path):
        super().__init__(target, layer_ids)
        self.cfg, self.target, self.spill = cfg, str(target), spill
        self.engine = VllmEngine(cfg, log_path)
        self.start = {**capture_settings(layer_ids, self.norm.num_layers, connector, spill), "dtype": dtype,
                      "trust_remote_code": trust_remote_code,
                      "extra": {"enable_chunked_prefill": False, "max_model_len": cfg.max_model_len or max_length + 1}}

    def __enter__(self) -> "OfflineStates":
        self.engine.__enter__()
        try:
            self.engine.start(self.target, **self.start)
        except BaseException:
            self.engine.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.engine.stop()
        shutil.rmtree(self.spill, ignore_errors=True)

    def timing(self) -> dict[str, float]:
        """`import_seconds` and `startup_seconds`, and `load_seconds` (the two), as the stages record them."""
        engine = self.engine
        return {"import_seconds": engine.import_seconds, "startup_seconds": engine.startup_seconds,
                "load_seconds": engine.import_seconds + engine.startup_seconds}

    def files(self, prompts: list[list[int]]) -> list[Path]:
        return [Path(path) for path in self.engine.hidden_states(prompts, self.spill)["paths"]]


class EngineStates(StateRows):
    """A batch's aux and final states from the server at `url` (see the module docstring)."""

    def __init__(self, url: str, target: str, layer_ids: list[int], retries: int, timeout_s: float):
        super().__init__(target, layer_ids)
        self.url, self.retries, self.timeout_s = url, retries, timeout_s
        self.model = served_models(url, timeout_s, retries)[0]
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-states")
        self.seconds = 0.0  # wall time spent waiting for the server (the engine's share of a fine-tune)
        self.rows = 0

    def states_file(self, prompt: list[int]) -> Path:
        answer = request_json(f"{self.url}/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1,
                                                             "temperature": 0.0}, self.timeout_s, self.retries)
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise RegraftError(self.url, "the server returned no hidden_states_path",
                               "start it with the extraction flags (stages/common/engines/vllm_states.py "
                               "serve_command), or leave finetune.engine.server_url unset to let regraft start one")
        return Path(path)

    def files(self, prompts: list[list[int]]) -> list[Path]:
        return list(self.pool.map(self.states_file, prompts))

    def batch_states(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        states = super().batch_states(batch)
        self.seconds += time.perf_counter() - started
        self.rows += batch["input_ids"].shape[0]
        return states

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def read_engine_states(path: Path, prompt: list[int]) -> torch.Tensor:
    """[T, layers, H] from the connector's file, in the engine's dtype, once its writer has let go of the lock (the
    lock file exists before the request's answer does); checked against the prompt it belongs to, and removed once
    read."""
    from safetensors.torch import load_file

    with contextlib.suppress(FileNotFoundError), open(f"{path}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps while the connector still writes
    saved = load_file(path)
    path.unlink()
    Path(f"{path}.lock").unlink(missing_ok=True)
    if saved["token_ids"].tolist() != prompt:
        raise RegraftError(path, "the engine saved states for other tokens than the prompt sent",
                           "report this with the vLLM version; rerun the stage")
    return saved["hidden_states"]


class EngineRows:
    """Tokenized chats whose `take` adds the target's states from the server: the rows a fine-tune reads from
    shards, computed when asked for (the same chats in the same order as the features stage's)."""

    def __init__(self, data: dict[str, torch.Tensor], states: EngineStates):
        self.data, self.states = data, states

    def __len__(self) -> int:
        return self.data["input_ids"].shape[0]

    def take(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = {name: tensor[indices] for name, tensor in self.data.items()}
        batch["aux_hidden"], batch["last_hidden"] = self.states.batch_states(batch)
        return batch
