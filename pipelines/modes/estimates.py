"""What a run will cost, from its config and what is on disk, before any work (pipeline.plan=true).

Three figures per node, each None with the reason when an input is not at hand yet (a model a stage builds):
- `feature_bytes`: the cached target states (tokens counted from the data with the target's tokenizer, times the
  bytes a stored position costs at the target's width and the features' dtype);
- `checkpoint_bytes`: the drafter it exports and the DeepSpeed checkpoints it keeps (weights and Adam's moments);
- `flops` and `gpu_hours`: the arithmetic FLOPs of its model work, over the chosen device's rate.

FLOPs count 2 per parameter per token for a forward and 6 for a forward and backward (the active parameters of a
mixture of experts: `num_experts_per_tok` of its routed experts). Decoding is memory-bound, so for probe, evaluate
and regenerate the figure is a lower bound. A device's rate is `tflops` x `utilisation` from `plan.devices`;
`tflops: null` is this machine's, measured here with a matrix product.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from stages.common.contract.artifacts import read_manifest, write_json_atomic
from stages.common.drafter.config import drafter_config_for, language_model_config, parse_config

# where counts are kept across commands (plan_pipeline sets paths.outputs/estimates): a plan of unchanged inputs
# loads no tokenizer and builds no model (each count keyed by its arguments and the size and mtime of the files
# they name)
COUNTS_FOLDER: Path | None = None

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ID_AND_MASK_BYTES = 9  # every stored position also holds its int64 id and bool loss mask
ADAM_BYTES_PER_PARAM = 12  # a DeepSpeed checkpoint: fp32 weights and Adam's two fp32 moments


@dataclass
class Estimate:
    tokens: int | None = None
    feature_bytes: int | None = None
    checkpoint_bytes: int | None = None
    flops: float | None = None
    gpu_hours: float | None = None
    rank_memory: dict[str, int] | None = None  # a fine-tune rank's peak GPU bytes, by part (stages/common/drafter/memory.py)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "feature_bytes": self.feature_bytes, "checkpoint_bytes": self.checkpoint_bytes,
                "flops": self.flops, "gpu_hours": self.gpu_hours, "rank_memory": self.rank_memory,
                "notes": self.notes}


def memoized_on_disk(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (of JSON-able arguments and result) memoized in this process and, with COUNTS_FOLDER set, on disk."""
    memo = lru_cache(maxsize=16)(function)

    @wraps(function)
    def wrapper(*args: Any) -> Any:
        if COUNTS_FOLDER is None:
            return memo(*args)
        from pipelines.core.cache import fingerprint

        files = [fingerprint(arg) for arg in args if isinstance(arg, str) and len(arg) < 4096 and os.path.exists(arg)]
        key = hashlib.sha256(json.dumps([function.__name__, args, files]).encode()).hexdigest()[:16]
        path = COUNTS_FOLDER / f"{function.__name__}-{key}.json"
        if path.is_file():
            return tuple(json.loads(path.read_text()))
        result = memo(*args)
        with contextlib.suppress(OSError):  # not kept: the next plan counts again
            COUNTS_FOLDER.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, list(result))
        return result
    wrapper.cache_clear = memo.cache_clear  # type: ignore[attr-defined]
    return wrapper


class Unknown(Exception):
    """An input of an estimate that is not at hand; its message says which and why."""


def model_config(folder: str) -> dict[str, Any]:
    """config.json of a model folder, its language model's part for multimodal ones (Kimi-K2.5's text_config)."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise Unknown(f"{path} is not there yet" + (" (a stage builds it)" if "/cache/" in str(path) else ""))
    return language_model_config(json.loads(path.read_text()))


@memoized_on_disk
def _target_params(config_text: str) -> tuple[int, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_text)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    routed, chosen = getattr(config, "n_routed_experts", None), getattr(config, "num_experts_per_tok", None)
    active = total - experts + (experts * chosen // routed if routed and chosen else experts)
    return total, active


def target_params(folder: str) -> tuple[int, int]:
    """(total, active per token) parameters of a target, counted on a model built on the meta device."""
    return _target_params(json.dumps(model_config(folder), sort_keys=True))


@memoized_on_disk
def _drafter_params(config_text: str) -> tuple[int]:
    import torch

    from stages.common.drafter.config import DrafterConfig
    from stages.common.drafter.eagle3 import Eagle3Drafter

    with torch.device("meta"):
        return (sum(p.numel() for p in Eagle3Drafter(DrafterConfig(**json.loads(config_text))).parameters()),)


def drafter_params(config: Any) -> int:
    """Parameters of a drafter (DrafterConfig), built on the meta device."""
    return _drafter_params(json.dumps(dataclasses.asdict(config), sort_keys=True))[0]


def bytes_per_position(target: dict[str, Any], aux_layers: int, dtype: str) -> int:
    return (aux_layers + 1) * int(target["hidden_size"]) * BYTES.get(dtype, 4) + ID_AND_MASK_BYTES


@memoized_on_disk
def _chat_tokens(tokenizer_dir: str, data: str, max_length: int, trust_remote_code: bool, sample_rows: int
                 ) -> tuple[int, int, int]:
    from stages.common.data.chat import batched, encode_chats, load_tokenizer, read_conversations

    tokenizer = load_tokenizer(tokenizer_dir, trust_remote_code)
    rows = sum(1 for _ in read_conversations(Path(data)))
    counted, tokens = 0, 0
    for batch in batched(read_conversations(Path(data)), 256):
        batch = batch[: sample_rows - counted]
        tokens += sum(len(ids) for ids, _ in encode_chats(tokenizer, batch, max_length))
        counted += len(batch)
        if counted >= sample_rows:
            break
    return rows, counted, tokens


def chat_tokens(tokenizer_dir: str, data: str, max_length: int, trust_remote_code: bool, sample_rows: int
                ) -> tuple[int, int, list[str]]:
    """(rows, real tokens after truncation to max_length, notes) of a chat file: the first `sample_rows` rows
    tokenized, the rest scaled from them."""
    if not Path(data).exists():
        raise Unknown(f"{data} is not there yet" + (" (a stage writes it)" if "/cache/" in data else ""))
    model_config(tokenizer_dir)  # the tokenizer lives beside the model's config
    rows, counted, tokens = _chat_tokens(tokenizer_dir, data, max_length, trust_remote_code, sample_rows)
    if counted < rows:
        return rows, round(tokens * rows / max(counted, 1)), [f"tokens scaled from the first {counted} of {rows} rows"]
    return rows, tokens, []


def cpu_model() -> str:
    """This machine's CPU as /proc/cpuinfo names it (empty where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def measured_tflops(threads: int | None) -> float:
    """This machine's float32 matrix-product rate (TFLOP/s), over a quarter of a second; kept per CPU model, core
    count, thread count and torch version, so that the same plan twice gives the same figures."""
    from importlib.metadata import version

    return _measured_tflops(threads, cpu_model(), os.cpu_count() or 1, version("torch"))[0]


@memoized_on_disk
def _measured_tflops(threads: int | None, _cpu: str, _cores: int, _torch: str) -> tuple[float]:
    import torch

    if threads:
        torch.set_num_threads(threads)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    start, products = time.perf_counter(), 0
    while time.perf_counter() - start < 0.25:
        a @ b
        products += 1
    return (products * 2 * 512 ** 3 / (time.perf_counter() - start) / 1e12,)


def device_rate(plan: DictConfig, threads: int | None) -> tuple[float, str]:
    """FLOP/s of plan.device and how it was found."""
    device = plan.devices[plan.device]
    utilisation = float(device.utilisation)
    if device.tflops is None:
        tflops = measured_tflops(threads)
        return tflops * 1e12 * utilisation, (f"{plan.device}: {tflops:.3f} TFLOP/s measured here (float32 matrix "
                                             f"product) x utilisation {utilisation:g}")
    return float(device.tflops) * 1e12 * utilisation, (f"{plan.device}: {float(device.tflops):g} TFLOP/s x "
                                                       f"utilisation {utilisation:g}")


def optimizer_steps(config: DictConfig, rows: int) -> int:
    ranks = int(config.nproc) * int(config.nodes)
    per_step = int(config.micro_batch_size) * int(config.deepspeed.gradient_accumulation_steps) * ranks
    train_rows = max(1, math.floor(rows * (1 - float(config.val_fraction))))
    steps = int(config.epochs) * math.ceil(train_rows / per_step)
    return min(steps, int(config.max_steps)) if config.max_steps else steps


@dataclass
class PlanContext:
    """What every node's estimate shares: the device's rate, the training data and drafter a fine-tune starts
    from (resolved to paths), how many rows to tokenize."""

    rate: float | None  # FLOP/s; None: no device rate (the plan's problems say why)
    data: str  # the chats the fine-tunes train on
    source: str | None  # the source drafter folder
    draft_vocab_size: int
    sample_rows: int
    on_gpus: bool = False  # priced on a GPU with a memory size: each fine-tune's rank memory is estimated


def training_rows(config: DictConfig, context: PlanContext, data: str | None = None) -> tuple[int, int, list[str]]:
    return chat_tokens(config.target, data or context.data, int(config.max_length), bool(config.trust_remote_code),
                       context.sample_rows)


def features_estimate(config: DictConfig, context: PlanContext) -> Estimate:
    if config.part_outputs:
        return Estimate(feature_bytes=0, flops=0.0, notes=["joins its parts' shards: nothing computed"])
    rows, tokens, notes = training_rows(config, context, config.data)
    if config.part is not None:  # an even share of the rows (stages/common/data/parts.py splits by row)
        rows, tokens = math.ceil(rows / config.parts), math.ceil(tokens / config.parts)
    aux = len(config.aux_layer_ids) if config.aux_layer_ids else 3
    per_position = bytes_per_position(model_config(config.target), aux, str(config.dtype))
    stored = tokens + rows if str(config.layout) == "ragged" else rows * int(config.max_length)
    _, active = target_params(config.target)
    notes.append(f"{stored:,} stored positions x {per_position:,} B ({config.layout})")
    return Estimate(tokens=tokens, feature_bytes=stored * per_position, flops=2.0 * active * tokens, notes=notes)


def drafter_of(config: DictConfig, context: PlanContext) -> tuple[Any, str]:
    """The config of the drafter a fine-tune trains, and where it came from."""
    if str(config.init) != "scratch":  # the shape of the drafter it starts from, read from its config.json
        for folder in (config.drafter, context.source):
            for candidate in (Path(folder or ""), Path(folder or "") / "drafter"):
                if folder and (candidate / "config.json").exists():
                    raw = json.loads((candidate / "config.json").read_text())
                    return parse_config(raw, candidate / "config.json")[1], f"the shape of {candidate}"
    model_config(config.target)
    family = config.family or "eagle3"
    size = draft_vocab_size(config.vocab_map) or context.draft_vocab_size
    return drafter_config_for(config.target, size, family=family), f"a fresh {family} drafter"


def draft_vocab_size(vocab_map: str | None) -> int | None:
    """The size of a vocab map already there (a stage output: its manifest says it), else None."""
    if not vocab_map or not Path(vocab_map).exists():
        return None
    manifest = read_manifest(vocab_map) if Path(vocab_map).is_dir() else None
    if manifest is not None and "draft_vocab_size" in manifest.get("metrics", {}):
        return int(manifest["metrics"]["draft_vocab_size"])
    from stages.common.drafter.vocab import load_vocab_map  # torch: a map given as a file

    return load_vocab_map(vocab_map).draft_vocab_size


@memoized_on_disk
def _rank_memory(config_text: str, micro_batch: int, seq: int, ttt_steps: int, zero_stage: int, gpus_per_node: int,
                 nodes: int, bf16: bool) -> tuple[int, int, int]:
    import torch

    from stages.common.drafter.config import DrafterConfig
    from stages.common.drafter.memory import fine_tune_memory

    found = fine_tune_memory(DrafterConfig(**json.loads(config_text)), micro_batch, seq, ttt_steps, zero_stage,
                             gpus_per_node, nodes, dtype=torch.bfloat16 if bf16 else torch.float32)
    return found.model_states, found.step, found.target_side


def rank_memory(config: DictConfig, drafter: Any) -> dict[str, int]:
    """A fine-tune rank's peak GPU memory by part, bf16 unless deepspeed.bf16=false (stages/common/drafter/memory.py)."""
    ds = config.deepspeed
    parts = _rank_memory(json.dumps(dataclasses.asdict(drafter), sort_keys=True), int(config.micro_batch_size),
                         int(config.max_length), int(config.ttt_steps), int(ds.zero_stage), int(config.nproc),
                         int(config.nodes), ds.bf16 is not False)
    return dict(zip(("model_states", "step", "target_side"), parts)) | {"total": sum(parts)}


def finetune_estimate(config: DictConfig, context: PlanContext) -> Estimate:
    drafter, shape = drafter_of(config, context)
    # before the data: a plan whose chats a stage writes still gets it
    memory = rank_memory(config, drafter) if context.on_gpus else None
    try:
        rows, tokens, notes = training_rows(config, context, config.data)  # its own chats (the source build's)
    except Unknown as exc:
        return Estimate(rank_memory=memory, notes=[str(exc)])
    params = drafter_params(drafter)
    target = model_config(config.target)
    steps = optimizer_steps(config, rows)
    ranks = int(config.nproc) * int(config.nodes)
    rows_seen = steps * int(config.micro_batch_size) * int(config.deepspeed.gradient_accumulation_steps) * ranks
    positions = rows_seen * int(config.max_length)  # rows are padded to max_length; every TTT step reads them all
    flops = 6.0 * params * positions * int(config.ttt_steps) + 2.0 * int(target["hidden_size"]) * \
        int(target["vocab_size"]) * positions  # the drafter's steps, and the target's head on its final states
    notes += [f"{steps:,} steps x {rows_seen // max(steps, 1):,} rows x {config.max_length} positions x "
              f"{config.ttt_steps} TTT steps; {params:,} parameters ({shape})"]
    if config.engine.enabled or not config.features:  # the target runs beside it: online, or inside the stage
        _, active = target_params(config.target)
        flops += 2.0 * active * rows_seen * tokens / max(rows, 1)
        notes.append("the target's forward on every batch (online features)")
    kept = int(config.keep_checkpoints) or math.ceil(steps / int(config.checkpoint_every))
    kept = min(kept, math.ceil(steps / int(config.checkpoint_every)))
    return Estimate(tokens=tokens, checkpoint_bytes=params * 4 + kept * params * ADAM_BYTES_PER_PARAM, flops=flops,
                    rank_memory=memory,
                    notes=notes + [f"{kept} DeepSpeed checkpoint(s) kept, {ADAM_BYTES_PER_PARAM} B per parameter"])


def probe_turns(prompts: str, num_prompts: int) -> int:
    if prompts == "builtin" or not Path(prompts).exists():
        return num_prompts  # the built-in prompts, or a file a stage writes: one turn each, at least
    from stages.common.data.chat import read_conversations

    conversations = list(read_conversations(Path(prompts)))[:num_prompts]
    return sum(sum(message["role"] == "user" for message in messages) for messages in conversations)


def probe_estimate(config: DictConfig, context: PlanContext) -> Estimate:
    _, active = target_params(config.target)
    turns = sum(probe_turns(str(entry.path), int(config.num_prompts)) for entry in config.eval_sets)
    # each new token verified with up to num_steps drafts beside it, then once more by plain greedy decoding
    positions = turns * int(config.max_new_tokens) * (int(config.num_steps) + 2)
    return Estimate(flops=2.0 * active * positions,
                    notes=[f"{turns} turns of {len(config.eval_sets)} eval set(s) x {config.max_new_tokens} tokens; "
                           "decoding is memory-bound, so the hours "
                           "are a lower bound"])


def regenerate_estimate(config: DictConfig, context: PlanContext) -> Estimate:
    if config.part_outputs:
        return Estimate(flops=0.0, notes=["joins its parts: nothing computed"])
    _, active = target_params(config.target)
    rows, prompt_tokens, notes = chat_tokens(config.target, config.data, 1 << 30, bool(config.trust_remote_code),
                                             context.sample_rows)
    rows = min(rows, int(config.num_samples)) if config.num_samples else rows
    tokens = prompt_tokens + rows * int(config.max_tokens)  # at most max_tokens per answer
    if config.part is not None:
        tokens = math.ceil(tokens / config.parts)
    return Estimate(tokens=tokens, flops=2.0 * active * tokens,
                    notes=notes + ["prompts and answers of at most max_tokens; decoding is memory-bound, so the "
                                   "hours are a lower bound"])


ESTIMATORS = {"features": features_estimate, "finetune": finetune_estimate, "probe": probe_estimate,
              "regenerate": regenerate_estimate}
CPU_ONLY = {"world": "the built-in world: minutes on CPU", "vocab_map": "token counts on CPU",
            "compare": "two maps compared on CPU", "remap": "a row permutation on CPU",
            "diagnose": "held-out rows through the targets and a ridge fit: minutes"}


def estimate(stage: str, config: DictConfig, context: PlanContext) -> Estimate:
    """A node's figures; what it cannot know yet is None, with the reason in its notes."""
    if stage not in ESTIMATORS:
        return Estimate(gpu_hours=0.0, notes=[CPU_ONLY.get(stage, "no model work to speak of")])
    try:
        found = ESTIMATORS[stage](config, context)
    except Unknown as exc:
        return Estimate(notes=[str(exc)])
    if found.flops is not None and context.rate:
        found.gpu_hours = found.flops / context.rate / 3600
    return found
