"""The compare stage's config (stages/compare.py): two maps, and where the comparison goes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from stages.common.contract.stage import register_schema


@dataclass
class CompareConfig:
    a: str = MISSING  # e.g. the source drafter (its own map)
    b: str = MISSING  # e.g. the map built for the new target
    out: Optional[str] = None  # where to write compare.json; None: print only


register_schema("compare", CompareConfig)
