"""The preflight guard: refuse to spend a fine-tune on a drafter whose lm_head points at the wrong tokens.

Two checks before the first step: the drafter's own draft vocab against the training map (positions that name
the same target id), and step-0 accuracy of the init on one batch beside the same drafter with its lm_head
remapped in memory. Both sets of numbers are returned for logging either way.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from stages.common.eagle3 import Eagle3Drafter
from stages.common.errors import RegraftError
from stages.common.vocab import VocabMap
from stages.compare import compare_vocab_maps


@dataclass(frozen=True)
class Preflight:
    positions_agree: int
    draft_vocab_size: int
    shared_ids: int
    step0_acc: float | None = None
    step0_loss: float | None = None
    remapped_step0_acc: float | None = None
    as_is_step0_acc: float | None = None  # init=remap: the source drafter before remap, on the same batch
    as_is_step0_loss: float | None = None

    @property
    def misaligned(self) -> float:
        return 1.0 - self.positions_agree / max(self.draft_vocab_size, 1)

    def metrics(self) -> dict[str, float]:
        values = {"preflight_positions_agree": self.positions_agree, "preflight_misaligned": self.misaligned,
                  "preflight_shared_ids": self.shared_ids, "preflight_step0_acc": self.step0_acc,
                  "preflight_step0_loss": self.step0_loss, "preflight_remapped_step0_acc": self.remapped_step0_acc,
                  "preflight_as_is_step0_acc": self.as_is_step0_acc, "preflight_as_is_step0_loss": self.as_is_step0_loss}
        return {k: float(v) for k, v in values.items() if v is not None}


def remapped_in_memory(drafter: Eagle3Drafter, own_map: VocabMap, training_map: VocabMap) -> Eagle3Drafter:
    """The same drafter with lm_head rows moved to the training map's positions (missing rows kept as they were)."""
    from stages.remap import RemapPlan

    plan = RemapPlan.between(own_map, training_map)
    remapped = copy.deepcopy(drafter)
    have = plan.source_rows >= 0
    with torch.no_grad():
        remapped.lm_head.weight[have] = drafter.lm_head.weight[plan.source_rows[have]]
    return remapped


def check(preflight: Preflight, init: str, max_misaligned: float, consent: bool, where: str) -> None:
    if init != "remap" and preflight.misaligned > max_misaligned and not consent:
        raise RegraftError(where, f"only {preflight.positions_agree} of {preflight.draft_vocab_size} draft positions "
                           f"map to the same target token ({preflight.shared_ids} ids shared) with init={init}",
                           "run remap, or set finetune.init=remap (finetune.guard.consent=true to train anyway)")
    near_chance = preflight.step0_acc is not None and preflight.remapped_step0_acc is not None and \
        preflight.remapped_step0_acc > 0.05 and preflight.step0_acc < 0.25 * preflight.remapped_step0_acc
    if near_chance and not consent:
        raise RegraftError(where, f"step-0 accuracy {preflight.step0_acc:.3f} is near chance while the same drafter "
                           f"remapped scores {preflight.remapped_step0_acc:.3f}",
                           "run remap, or set finetune.init=remap (finetune.guard.consent=true to train anyway)")


def compare_with_training_map(own_map: VocabMap, training_map: VocabMap) -> Preflight:
    comparison = compare_vocab_maps(own_map, training_map)
    return Preflight(comparison.positions_agree, training_map.draft_vocab_size, comparison.shared_ids)
