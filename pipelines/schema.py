"""Typed schemas of the pipeline-level config groups (the stages register their own)."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from stages.common.cli import register_schema


@dataclass
class TargetConfig:
    path: str = MISSING  # model folder (config.json, safetensors, tokenizer)
    builtin: bool = False  # made by the world stage


@dataclass
class SourceConfig:
    path: str = MISSING  # drafter folder, sglang or speculators layout
    builtin: bool = False


@dataclass
class DataConfig:
    train: str = MISSING  # chat JSONL
    builtin: bool = False


register_schema("target", TargetConfig)
register_schema("source", SourceConfig)
register_schema("data", DataConfig)
