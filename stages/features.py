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
import shutil
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from omegaconf import MISSING, DictConfig, OmegaConf
from tqdm import tqdm

from stages.common.contract.artifacts import StagedOutput, engine_fields, staged_output
from stages.common.data.chat import load_tokenizer, tokenized_chats
from stages.common.drafter.checkpoint import DrafterCheckpoint
from stages.common.data.parts import part_manifests, part_slice
from stages.common.drafter.config import OUTPUT_OF_LAYER, aux_layer_ids_for, convert_aux_layer_ids
from stages.common.contract.errors import RegraftError
from stages.common.data.feature_shards import LastHidden, Layout, ShardWriter
from stages.common.contract.stage import StageResult, register_schema, setting, stage_main
from stages.common.drafter.target import FinalNorm, TargetModel
from stages.common.engines.vllm_engine import VllmConfig, VllmEngine, check_engine, check_engine_here
from stages.common.engines.vllm_states import capture_settings, read_engine_states


class Mode(str, Enum):
    """Where a pipeline's fine-tunes get the target's states (with pipeline.offline=true; false runs the target in
    transformers inside each fine-tune)."""

    offline = "offline"  # this stage caches them once; the fine-tunes stream the shards
    online = "online"  # no stage caches them: each fine-tune asks a vLLM server per batch (finetune.engine)


class Backend(str, Enum):
    hf = "hf"  # the target in transformers, in this process
    vllm = "vllm"  # the target in vLLM (engine venv), states captured by its extract_hidden_states method


@dataclass
class FeaturesConfig:
    target: str = MISSING
    data: str = MISSING
    out: str = MISSING
    mode: Mode = Mode.offline  # offline: cache them here | online: fine-tunes ask a server (no features node)
    drafter: Optional[str] = None  # take the aux layers (and convention) from this drafter's config
    aux_layer_ids: Optional[list[int]] = None  # or give them, in the output-of-layer convention
    trust_remote_code: bool = False  # run the code in the target's folder (Kimi's tokenizer and model need it)
    max_length: int = setting(256, at_least=4)  # tokens per conversation, as the fine-tunes will truncate them
    batch_size: int = setting(8, at_least=1)  # conversations per target forward
    rows_per_shard: int = setting(512, at_least=1)  # conversations per safetensors shard
    # the final hidden state at every position (all), or only where a TTT loss under any finetune.loss_mask reads
    # it (loss_masked: answers and the token after each), saving H x itemsize at every other position
    last_hidden: LastHidden = LastHidden.all
    # ragged: each conversation's real tokens (and the one after) only, padded when read; padded: every row at
    # max_length, as the target ran them (what a ragged set is checked against; the fine-tunes are bit-identical)
    layout: Layout = Layout.ragged
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


def check_before_work(cfg: dict, stage: str) -> None:
    """What the pipeline asks of every stage before any work, where it will run (pipelines/launchers.py): an engine
    this machine can run as asked."""
    if Backend(cfg["backend"]) is Backend.vllm:
        check_engine_here(OmegaConf.create(cfg["vllm"]), f"{stage}.", cfg.get("target"),
                          stock_connector=cfg["vllm_connector"] == "stock")


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
    """The engine's start settings for vLLM's `extract_hidden_states` method (stages/common/engines/vllm_states.py)."""
    return {**capture_settings(layer_ids, num_layers, cfg.vllm_connector, spill),
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
        writer = ShardWriter(staged.path, cfg.rows_per_shard, cfg.last_hidden, cfg.layout)
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
                      last_hidden=LastHidden(cfg.last_hidden).value, layout=Layout(cfg.layout).value)
    return StageResult(Path(cfg.out), metrics, f"{count} conversations, {stored.shards} shards, "
                       f"{stored.bytes / 2 ** 20:.1f} MiB ({metrics['bytes_per_token']:.0f} bytes per token)")


if __name__ == "__main__":
    raise SystemExit(stage_main("features", run))
