"""The remap stage's config (stages/remap.py): the drafter, the map it moves to, and the rows with no source."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from omegaconf import MISSING

from stages.common.contract.stage import register_schema


class Fallback(str, Enum):
    verifier = "verifier"
    random = "random"
    mean = "mean"


class OutputLayout(str, Enum):
    source = "source"  # keep the source drafter's layout
    sglang = "sglang"
    speculators = "speculators"


@dataclass
class RemapConfig:
    drafter: str = MISSING  # source drafter folder, either layout
    vocab_map: str = MISSING  # destination map: vocab_map folder, SpecForge .pt, or a drafter checkpoint
    verifier: Optional[str] = None  # target model folder; needed by fallback=verifier and verifier_lm_head
    verifier_name: Optional[str] = None  # the hub id the verifier is deployed by (None: the folder as given)
    out: str = MISSING
    fallback: Fallback = Fallback.verifier  # rows the source vocab lacks: verifier | random | mean
    match_source_scale: bool = False  # rescale verifier rows to the mean row norm of the source lm_head
    layout: OutputLayout = OutputLayout.source  # output layout: source | sglang | speculators
    seed: int = 0  # for fallback=random


register_schema("remap", RemapConfig)
