"""features stage: run the target once over the training data and cache what the drafter trains on.

In: the target model folder, chat JSONL, and the aux layers (from a drafter's config, or given).
Out: `features-NNNNN.safetensors` shards (stages/common/feature_shards.py) and a manifest with the aux layer ids
(output-of-layer convention), `last_hidden` (where the final state is stored: `all` positions, or `loss_masked`,
only where a TTT loss can read it) and what the shards cost (`bytes`, `bytes_per_token`). A sweep of N fine-tunes
(`finetune.features=DIR`) then runs the expensive target forward once instead of N times, and streams the shards.
Timing in the metrics: `load_seconds` (the target's load; vllm: `import_seconds` + `startup_seconds`) and
`extract_tok_s` (real tokens per second from the second batch on).

    python -m stages.features target=DIR data=FILE drafter=DRAFTER out=DIR
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from omegaconf import MISSING, DictConfig
from tqdm import tqdm

from stages.common.artifacts import StagedOutput, engine_fields, staged_output
from stages.common.chat import load_tokenizer, tokenized_chats
from stages.common.checkpoint import DrafterCheckpoint
from stages.common.data_parts import part_manifests, part_slice
from stages.common.drafter_config import INPUT_OF_LAYER, OUTPUT_OF_LAYER, aux_layer_ids_for, convert_aux_layer_ids
from stages.common.errors import RegraftError
from stages.common.feature_shards import LastHidden, ShardWriter
from stages.common.stage import StageResult, register_schema, setting, stage_main
from stages.common.target import FinalNorm, TargetModel
from stages.common.vllm_engine import VllmConfig, VllmEngine, check_engine


class Backend(str, Enum):
    hf = "hf"  # the target in transformers, in this process
    vllm = "vllm"  # the target in vLLM (engine venv), states captured by its extract_hidden_states method


@dataclass
class FeaturesConfig:
    target: str = MISSING
    data: str = MISSING
    out: str = MISSING
    drafter: Optional[str] = None  # take the aux layers (and convention) from this drafter's config
    aux_layer_ids: Optional[list[int]] = None  # or give them, in the output-of-layer convention
    trust_remote_code: bool = False  # run the code in the target's folder (Kimi's tokenizer and model need it)
    max_length: int = setting(256, at_least=4)  # tokens per conversation, as the fine-tunes will truncate them
    batch_size: int = setting(8, at_least=1)  # conversations per target forward
    rows_per_shard: int = setting(512, at_least=1)  # conversations per safetensors shard
    # the final hidden state at every position (all), or only where a TTT loss under any finetune.loss_mask reads
    # it (loss_masked: answers and the token after each), saving H x itemsize at every other position
    last_hidden: LastHidden = LastHidden.all
    backend: Backend = Backend.hf  # hf: transformers here | vllm: vLLM's extract_hidden_states (make venv-vllm)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    vllm_connector: str = "cpu"  # cpu: regraft's connector (a CPU build) | stock: vLLM's own (GPU)
    # across nodes: the pipeline splits the data into this many contiguous parts, one job and one cached output
    # each (`part`), and joins them with a node that only indexes the part outputs (`part_outputs`): no state is copied
    parts: int = setting(1, at_least=1)
    part: Optional[int] = setting(None, at_least=0)  # this job's part of `parts`; None: all the data
    part_outputs: list[str] = field(default_factory=list)  # join: complete part outputs, in order; nothing is computed
    dtype: str = "float32"  # the target's dtype while it runs (the shards keep what it computes)


def check_features(cfg: DictConfig, where: str) -> None:
    if Backend(cfg.backend) is Backend.vllm:
        check_engine(cfg.vllm, f"{where}." if where else "")


register_schema("features", FeaturesConfig, check=check_features)


def aux_layers(cfg: DictConfig) -> list[int]:
    """Output-of-layer ids: the drafter's (converted), the given ones, or the default for the target's depth."""
    if cfg.drafter:
        config = DrafterCheckpoint.open(cfg.drafter).config
        if config.aux_layer_ids:
            return convert_aux_layer_ids(config.aux_layer_ids, config.aux_convention, OUTPUT_OF_LAYER)
    if cfg.aux_layer_ids:
        return list(cfg.aux_layer_ids)
    return aux_layer_ids_for(json.loads((Path(cfg.target) / "config.json").read_text())["num_hidden_layers"])


Batch = dict[str, torch.Tensor]


def batches(rows: Batch, size: int) -> Iterator[Batch]:
    count = rows["input_ids"].shape[0]
    for start in tqdm(range(0, count, size), desc="features", unit=" batch", mininterval=1.0):
        yield {name: tensor[start:start + size] for name, tensor in rows.items()}


def hf_features(cfg: DictConfig, rows: Batch, layer_ids: list[int], _staged: StagedOutput,
                timing: dict[str, float]) -> Iterator[tuple[Batch, ...]]:
    start = time.perf_counter()
    target = TargetModel.load(cfg.target, layer_ids, OUTPUT_OF_LAYER, getattr(torch, cfg.dtype), cfg.trust_remote_code)
    timing["load_seconds"] = time.perf_counter() - start
    for batch in batches(rows, cfg.batch_size):
        features = target.batch_features(batch)
        yield batch, features.aux_hidden, features.last_hidden


def vllm_capture(cfg: DictConfig, layer_ids: list[int], num_layers: int, spill: Path) -> dict[str, Any]:
    """vLLM's `extract_hidden_states` method: the aux layers in vLLM's convention (the state after j layers, so
    output-of-layer i is j = i + 1) and the state after the last layer (j = L), through a hidden-states connector
    that writes each prompt's states to `spill`."""
    connector = {"cpu": ("CpuHiddenStatesConnector", "stages.common.vllm_hidden_states"),
                 "stock": ("ExampleHiddenStatesConnector", None)}[cfg.vllm_connector]
    capture = convert_aux_layer_ids(layer_ids, OUTPUT_OF_LAYER, INPUT_OF_LAYER) + [num_layers]
    kv_transfer = {"kv_connector": connector[0], "kv_role": "kv_producer",
                   "kv_connector_extra_config": {"shared_storage_path": str(spill)}}
    if connector[1]:
        kv_transfer["kv_connector_module_path"] = connector[1]
    return {"speculative": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture}}},
            "kv_transfer": kv_transfer,
            "extra": {"enable_chunked_prefill": False, "max_model_len": cfg.vllm.max_model_len or cfg.max_length + 1}}


def vllm_features(cfg: DictConfig, rows: Batch, layer_ids: list[int], staged: StagedOutput,
                  timing: dict[str, float]) -> Iterator[tuple[Batch, ...]]:
    """The same rows through vLLM: each row's tokens (padding left out) as one prompt, prefill only; the final
    state gets the target's final norm here, as the shards store it (logits = lm_head(last_hidden))."""
    norm, out = FinalNorm.load(cfg.target), staged.path
    spill = out / "engine_states"
    with VllmEngine(cfg.vllm, out / "engine.log") as engine:
        engine.start(cfg.target, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                     **vllm_capture(cfg, layer_ids, norm.num_layers, spill))
        timing.update(import_seconds=engine.import_seconds, startup_seconds=engine.startup_seconds,
                      load_seconds=engine.import_seconds + engine.startup_seconds)
        staged.update(**engine.provenance())  # vLLM's own versions, not this venv's
        for batch in batches(rows, cfg.batch_size):
            lengths = batch["attention_mask"].sum(-1).tolist()
            prompts = [ids[:length].tolist() for ids, length in zip(batch["input_ids"], lengths)]
            paths = engine.hidden_states(prompts, spill)["paths"]
            aux = torch.zeros(*batch["input_ids"].shape, len(layer_ids) * norm.hidden_size)
            last = torch.zeros(*batch["input_ids"].shape, norm.hidden_size)
            for row, (path, length) in enumerate(zip(paths, lengths)):
                states = read_engine_states(Path(path), prompts[row])
                aux[row, :length] = states[:, :-1].flatten(1)
                last[row, :length] = norm(states[:, -1])
            yield batch, aux, last
    shutil.rmtree(spill, ignore_errors=True)


def read_engine_states(path: Path, prompt: list[int]) -> torch.Tensor:
    """[T, layers, H] from the connector's file (removed once read), checked against the prompt it belongs to."""
    from safetensors.torch import load_file

    saved = load_file(path)
    path.unlink()
    Path(f"{path}.lock").unlink(missing_ok=True)
    if saved["token_ids"].tolist() != prompt:
        raise RegraftError(path, "the engine saved states for other tokens than the prompt sent",
                           "report this with the vLLM version; rerun the stage")
    return saved["hidden_states"].float()


def extraction_rate(arrivals: list[tuple[float, int]]) -> dict[str, float]:
    """Real tokens per second once running: from the second batch's arrival to the last's (the first pays one-off
    allocations; the model's load is `load_seconds`). Needs three batches."""
    if len(arrivals) < 3:
        return {}
    return {"extract_tok_s": sum(tokens for _, tokens in arrivals[2:]) / (arrivals[-1][0] - arrivals[1][0])}


def join_parts(cfg: DictConfig) -> StageResult:
    """An output that indexes complete part outputs (open_features streams their shards in order)."""
    manifests = part_manifests(list(cfg.part_outputs), "features")
    same = ("aux_layer_ids", "aux_convention", "max_length", "last_hidden", "target")
    for part, manifest in zip(cfg.part_outputs[1:], manifests[1:]):
        differs = [key for key in same if manifest.get(key) != manifests[0].get(key)]
        if differs:
            raise RegraftError(part, f"differs from {cfg.part_outputs[0]} in {', '.join(differs)}",
                               "join parts of one features run (same target, aux layers and max_length)")
    summed = ("rows", "tokens", "shards", "bytes")
    metrics = {key: sum(m["metrics"].get(key, 0) for m in manifests) for key in summed}
    # each part's figure weighted by its rows (every row stores max_length positions)
    metrics["bytes_per_token"] = sum(m["metrics"]["bytes_per_token"] * m["metrics"]["rows"] for m in manifests) \
        / max(metrics["rows"], 1)
    metrics["parts"] = len(cfg.part_outputs)
    with staged_output(cfg.out, "features", cfg) as staged:
        staged.update(metrics=metrics, part_outputs=[str(Path(part).absolute()) for part in cfg.part_outputs],
                      **{key: manifests[0][key] for key in same if key in manifests[0]}, **engine_fields(manifests[0]))
    return StageResult(Path(cfg.out), metrics, f"{metrics['rows']} conversations in {len(cfg.part_outputs)} parts, "
                       f"{metrics['bytes'] / 2 ** 20:.1f} MiB")


def run(cfg: DictConfig) -> StageResult:
    if cfg.part_outputs:
        return join_parts(cfg)
    layer_ids = aux_layers(cfg)
    rows = tokenized_chats(load_tokenizer(cfg.target, cfg.trust_remote_code), Path(cfg.data), cfg.max_length)
    part = part_slice(rows["input_ids"].shape[0], cfg.part, cfg.parts, "features")
    rows = {name: tensor[part] for name, tensor in rows.items()}
    count = rows["input_ids"].shape[0]
    with staged_output(cfg.out, "features", cfg) as staged:
        writer = ShardWriter(staged.path, cfg.rows_per_shard, cfg.last_hidden)
        produce = vllm_features if Backend(cfg.backend) is Backend.vllm else hf_features
        timing: dict[str, float] = {}
        arrivals: list[tuple[float, int]] = []  # (when, real tokens) as each batch comes out of the target
        for batch, aux_hidden, last_hidden in produce(cfg, rows, layer_ids, staged, timing):
            arrivals.append((time.perf_counter(), int(batch["attention_mask"].sum())))
            writer.add({**batch, "aux_hidden": aux_hidden, "last_hidden": last_hidden})
        stored = writer.close()
        metrics = {"rows": count, "tokens": int(rows["attention_mask"].sum()), **stored.metrics(), **timing,
                   **extraction_rate(arrivals)}
        staged.update(metrics=metrics, aux_layer_ids=layer_ids, aux_convention=OUTPUT_OF_LAYER, part=cfg.part,
                      max_length=cfg.max_length, target=str(Path(cfg.target).absolute()),
                      last_hidden=LastHidden(cfg.last_hidden).value)
    return StageResult(Path(cfg.out), metrics, f"{count} conversations, {stored.shards} shards, "
                       f"{stored.bytes / 2 ** 20:.1f} MiB ({metrics['bytes_per_token']:.0f} bytes per token)")


if __name__ == "__main__":
    raise SystemExit(stage_main("features", run))
