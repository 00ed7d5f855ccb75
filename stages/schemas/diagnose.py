"""The diagnose stage's config (stages/diagnose.py): the drafter, both targets, the rows it measures and the fit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from stages.common.contract.stage import register_schema, setting
from stages.common.drafter.loss_mask import LossMask


@dataclass
class DiagnoseConfig:
    drafter: str = MISSING  # the remapped source drafter (a remap output), or any drafter on the training map
    target: str = MISSING  # the new target (B)
    target_a: Optional[str] = None  # the target the source drafter was trained for; None: no drift numbers
    data: str = MISSING  # B-domain chats (the training data)
    vocab_map: str = MISSING  # the training map
    out: str = MISSING
    max_rows: int = setting(64, at_least=2)  # conversations measured (half fit the maps, half are held out)
    max_length: int = setting(256, at_least=4)
    fit_share: float = setting(0.5, above=0, below=1)  # share of the rows the ridge maps are fitted on
    ridge: float = setting(1e-3, at_least=0)  # x the mean eigenvalue of B's Gram matrix (drift.RIDGE's value)
    realign_embeddings: bool = True  # also fold a map of the token embeddings into the drafter's first layer
    ttt_steps: int = setting(3, at_least=1)
    loss_mask: LossMask = LossMask.drafted
    trust_remote_code: bool = False
    seed: int = 0


register_schema("diagnose", DiagnoseConfig)
