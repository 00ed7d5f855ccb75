"""How the features stage lays its shards out (`Layout`) and where it keeps the final hidden state (`LastHidden`):
settings of the features config, kept free of torch so that a config naming them is checked without loading the
shard code (stages/common/data/feature_shards.py writes and reads them)."""
from __future__ import annotations

from enum import Enum


class Layout(str, Enum):
    """How a shard's rows are laid out."""

    ragged = "ragged"  # stored positions only (real tokens and the one after), rows concatenated
    padded = "padded"  # every row padded to max_length


class LastHidden(str, Enum):
    """Where the final hidden state is stored."""

    all = "all"  # every position: 4 * H values per position with the aux states
    loss_masked = "loss_masked"  # only where a TTT loss can read it: about the assistant share of H per position
