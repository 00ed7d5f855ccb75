"""Typed schemas of the pipeline-level config groups (the stages register their own)."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from stages.common.cli import register_schema


@dataclass
class TargetConfig:
    path: str = MISSING  # model folder (config.json, safetensors, tokenizer), or @world/target_b
    trust_remote_code: bool = False  # every stage that loads the target runs the code in its folder (Kimi's)


@dataclass
class SourceConfig:
    path: str = MISSING  # drafter folder, sglang or speculators layout, or @world/drafter_a


@dataclass
class DataConfig:
    train: str = MISSING  # chat JSONL for vocab_map, features and finetune
    prompts: str = "builtin"  # chat JSONL whose user turns probe and evaluate ask, or builtin


register_schema("target", TargetConfig)
register_schema("source", SourceConfig)
register_schema("data", DataConfig)
