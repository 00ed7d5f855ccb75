"""The features stage's config (stages/features.py), its rules, and what it asks of the machine it runs on."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING, DictConfig

from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Holds
from stages.common.contract.stage import register_schema, setting
from stages.common.data.feature_layout import LastHidden, Layout
from stages.common.engines.vllm_engine import (VllmConfig, check_engine, check_extraction_here, check_mla_target,
                                                engine_holds)


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
    rows_per_shard: int = setting(512, at_least=1)  # conversations per safetensors shard, at most
    # and at most this many MiB of rows a shard, as they wait in memory (padded to max_length; the file holds no more):
    # a Kimi-K2.5 row of 2,048 tokens is 117 MB in bf16, so 18 a shard, where 512 would wait as 60 GB
    shard_mb: float = setting(2048.0, above=0)
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
    dtype: str = "float32"  # the target's dtype while it runs, and the states' in the shards (bfloat16: half the bytes)


DTYPES = ("float32", "bfloat16", "float16")  # what the target runs in, and the shards store


def check_features(cfg: DictConfig, where: str) -> None:
    prefix = f"{where}." if where else ""
    if cfg.dtype not in DTYPES:
        raise RegraftError(f"{prefix}dtype={cfg.dtype}", "is not a dtype the features are computed and stored in",
                           f"set {prefix}dtype= to one of {', '.join(DTYPES)}")
    if Backend(cfg.backend) is Backend.vllm:
        check_engine(cfg.vllm, prefix)
        check_vllm_targets(cfg, where)


def check_vllm_targets(cfg: DictConfig, where: str) -> None:
    """No MLA target on vLLM's CPU build (vllm_engine.check_mla_target): asked of the stage run alone
    (check_features) and of a pipeline's features nodes (pipelines/modes/preflight.py)."""
    prefix = f"{where}." if where else ""
    if Backend(cfg.backend) is Backend.vllm:
        check_mla_target(cfg.vllm, cfg.get("target"), prefix, f"{prefix}backend=hf (transformers)",
                         "the states it caches")


def check_before_work(cfg: dict, stage: str) -> None:
    """What the pipeline asks of every stage before any work, where it will run (pipelines/launch/): an engine
    this machine can run as asked."""
    if Backend(cfg["backend"]) is Backend.vllm:
        check_extraction_here(cfg, stage)


def holds(cfg: DictConfig | dict, node_gpus: int) -> Holds:
    """The vLLM backend's engine, on as many GPUs as it is tensor-parallel on a GPU node; the hf backend a CPU."""
    if Backend(cfg["backend"]) is not Backend.vllm:
        return Holds()
    return engine_holds(int(cfg["vllm"]["tensor_parallel_size"]), node_gpus, "vLLM")


register_schema("features", FeaturesConfig, check=check_features)
