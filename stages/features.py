"""features stage: run the target once over the training data and cache what the drafter trains on.

In: the target model folder, chat JSONL, and the aux layers (from a drafter's config, or given).
Out: `features-NNNNN.safetensors` shards (stages/common/data/feature_shards.py) and a manifest with the aux layer ids
(output-of-layer convention), `last_hidden` (where the final state is stored: `all` positions, or `loss_masked`,
only where a TTT loss can read it), `layout` (`ragged`: real tokens only; `padded`: rows at max_length) and what
the shards cost (`bytes`, `bytes_per_token`, `bytes_vs_tokens`: the files over real tokens x bytes_per_token).
A sweep of N fine-tunes (`finetune.features=DIR`) then runs the expensive target forward once instead of N
times, and streams the shards.
Timing in the metrics: `load_seconds` (the target's load; vllm: `import_seconds` + `startup_seconds`) and
`extract_tok_s` (real tokens per second from the second batch on).

    python -m stages.features target=DIR data=FILE drafter=DRAFTER out=DIR
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import torch

from omegaconf import DictConfig
from tqdm import tqdm

from stages.common.contract.artifacts import StagedOutput, engine_fields, staged_output
from stages.common.data.chat import load_tokenizer, tokenized_chats
from stages.common.drafter.checkpoint import DrafterCheckpoint
from stages.common.data.parts import part_manifests, part_slice
from stages.common.drafter.config import OUTPUT_OF_LAYER, aux_layer_ids_for, convert_aux_layer_ids
from stages.common.contract.errors import RegraftError
from stages.common.data.feature_shards import LastHidden, Layout, ShardWriter
from stages.common.contract.stage import StageResult, stage_main
from stages.common.drafter.target import TargetModel
from stages.common.engines.vllm_states import OfflineStates
from stages.schemas.features import Backend, Mode


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


def vllm_features(cfg: DictConfig, rows: Batch, layer_ids: list[int], staged: StagedOutput,
                  timing: dict[str, float]) -> Iterator[tuple[Batch, ...]]:
    """The same rows through vLLM's offline engine (stages/common/engines/vllm_states.py): each row's tokens (padding
    left out) as one prompt, prefill only; the final state gets the target's final norm, as the shards store it
    (logits = lm_head(last_hidden))."""
    with OfflineStates(cfg.vllm, cfg.target, layer_ids, connector=cfg.vllm_connector, dtype=cfg.dtype,
                       trust_remote_code=cfg.trust_remote_code, max_length=cfg.max_length,
                       log_path=staged.path / "engine.log", spill=staged.path / "engine_states") as states:
        timing.update(states.timing())
        staged.update(**states.engine.provenance())  # vLLM's own versions, not this venv's
        for batch in batches(rows, cfg.batch_size):
            yield batch, *states.batch_states(batch)


def extraction_rate(arrivals: list[tuple[float, int]]) -> dict[str, float]:
    """Real tokens per second once running: from the second batch's arrival to the last's (the first pays one-off
    allocations; the model's load is `load_seconds`). Needs three batches."""
    if len(arrivals) < 3:
        return {}
    return {"extract_tok_s": sum(tokens for _, tokens in arrivals[2:]) / (arrivals[-1][0] - arrivals[1][0])}


def join_parts(cfg: DictConfig) -> StageResult:
    """An output that indexes complete part outputs (open_features streams their shards in order)."""
    manifests = part_manifests(list(cfg.part_outputs), "features")
    same = ("aux_layer_ids", "aux_convention", "max_length", "last_hidden", "layout", "target")
    for part, manifest in zip(cfg.part_outputs[1:], manifests[1:]):
        differs = [key for key in same if manifest.get(key) != manifests[0].get(key)]
        if differs:
            raise RegraftError(part, f"differs from {cfg.part_outputs[0]} in {', '.join(differs)}",
                               "join parts of one features run (same target, aux layers and max_length)")
    summed = ("rows", "tokens", "shards", "bytes", "stored_positions")
    metrics = {key: sum(m["metrics"].get(key, 0) for m in manifests) for key in summed}
    # each part's figure weighted by the positions it stores
    metrics["bytes_per_token"] = sum(m["metrics"]["bytes_per_token"] * m["metrics"]["stored_positions"]
                                     for m in manifests) / max(metrics["stored_positions"], 1)
    metrics["bytes_vs_tokens"] = metrics["bytes"] / max(metrics["tokens"] * metrics["bytes_per_token"], 1)
    metrics["parts"] = len(cfg.part_outputs)
    with staged_output(cfg.out, "features", cfg) as staged:
        staged.update(metrics=metrics, part_outputs=[str(Path(part).absolute()) for part in cfg.part_outputs],
                      **{key: manifests[0][key] for key in same if key in manifests[0]}, **engine_fields(manifests[0]))
    return StageResult(Path(cfg.out), metrics, f"{metrics['rows']} conversations in {len(cfg.part_outputs)} parts, "
                       f"{metrics['bytes'] / 2 ** 20:.1f} MiB")


def run(cfg: DictConfig) -> StageResult:
    if Mode(cfg.mode) is Mode.online:
        raise RegraftError("features.mode=online", "online features are computed by each fine-tune, not cached",
                           "run the finetune stage with engine.enabled=true, or set mode=offline to cache them")
    if cfg.part_outputs:
        return join_parts(cfg)
    layer_ids = aux_layers(cfg)
    rows = tokenized_chats(load_tokenizer(cfg.target, cfg.trust_remote_code), Path(cfg.data), cfg.max_length)
    part = part_slice(rows["input_ids"].shape[0], cfg.part, cfg.parts, "features")
    rows = {name: tensor[part] for name, tensor in rows.items()}
    count = rows["input_ids"].shape[0]
    with staged_output(cfg.out, "features", cfg) as staged:
        writer = ShardWriter(staged.path, cfg.rows_per_shard, cfg.last_hidden, cfg.layout,
                             shard_bytes=int(cfg.shard_mb * 2 ** 20))
        produce = vllm_features if Backend(cfg.backend) is Backend.vllm else hf_features
        dtype = getattr(torch, cfg.dtype)  # the target ran in it: stored as computed, never widened to float32
        timing: dict[str, float] = {}
        arrivals: list[tuple[float, int]] = []  # (when, real tokens) as each batch comes out of the target
        for batch, aux_hidden, last_hidden in produce(cfg, rows, layer_ids, staged, timing):
            arrivals.append((time.perf_counter(), int(batch["attention_mask"].sum())))
            writer.add({**batch, "aux_hidden": aux_hidden.to(dtype), "last_hidden": last_hidden.to(dtype)})
        stored = writer.close()
        metrics = {"rows": count, "tokens": int(rows["attention_mask"].sum()), **stored.metrics(), **timing,
                   **extraction_rate(arrivals)}
        staged.update(metrics=metrics, aux_layer_ids=layer_ids, aux_convention=OUTPUT_OF_LAYER, part=cfg.part,
                      max_length=cfg.max_length, target=str(Path(cfg.target).absolute()),
                      last_hidden=LastHidden(cfg.last_hidden).value, layout=Layout(cfg.layout).value)
    return StageResult(Path(cfg.out), metrics, f"{count} conversations, {stored.shards} shards, "
                       f"{stored.bytes / 2 ** 20:.1f} MiB ({metrics['bytes_per_token']:.0f} bytes per token)")


if __name__ == "__main__":
    raise SystemExit(stage_main("features", run))
