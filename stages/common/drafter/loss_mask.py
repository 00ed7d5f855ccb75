"""Which TTT predictions carry loss and count (`LossMask`): a setting of every stage that trains or measures a
drafter's TTT loss, kept free of torch so that a config naming it is checked without loading the training code
(stages/common/drafter/ttt.py applies it; docs/ttt-loss-mask.md says how each tool's rule differs)."""
from __future__ import annotations

from enum import Enum


class LossMask(str, Enum):
    """Which of step k's predictions (token p = t+2+k, at position t) carry loss and count, on the assistant mask m."""

    drafted = "drafted"  # m[t+1..p] all set: only tokens inference drafts (not a turn's first, never across turns)
    specforge = "specforge"  # m[p-2] = m[t+k]: SpecForge 0.2.0 / EAGLE-3 cnets.py
    speculators = "speculators"  # m[p-1] = m[t+1+k]: speculators, SpecForge #885 / #895
