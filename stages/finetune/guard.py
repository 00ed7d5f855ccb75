"""The finetune's preflight guard: refuse to spend a fine-tune on a drafter whose lm_head points at the wrong tokens.

Two checks before the first step: the drafter's own draft vocab against the training map (positions that name
the same target id), and step-0 accuracy of the init on one batch beside the same drafter with its lm_head
remapped in memory. Both sets of numbers are returned for logging either way; for init=remap the source drafter
as it was (before the remap) is measured on the same batch too, so every run carries both ends of the story.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from stages.common.contract.artifacts import read_manifest
from stages.common.data.feature_shards import Rows
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.drafter.target import TargetHead, TargetModel
from stages.common.drafter.ttt import LossMask
from stages.common.drafter.vocab import RemapPlan, VocabMap, compare_vocab_maps
from stages.finetune.loop import device_of, micro_batches, run_ttt


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
        """One name per figure: `loss_0`/`full_acc_0` as the TTT series name them (step 0 of TTT, at optimizer step
        0, on the first training batch); the remapped figure only where the drafter's own map differs from the
        training map (else it is the drafter as given, already `full_acc_0`); the map figures say which maps."""
        values = {"preflight_own_map_positions_agree": self.positions_agree, "preflight_misaligned": self.misaligned,
                  "preflight_own_map_shared_ids": self.shared_ids, "preflight_full_acc_0": self.step0_acc,
                  "preflight_loss_0": self.step0_loss, "preflight_as_is_full_acc_0": self.as_is_step0_acc,
                  "preflight_as_is_loss_0": self.as_is_step0_loss}
        if self.positions_agree < self.draft_vocab_size:
            values["preflight_remapped_full_acc_0"] = self.remapped_step0_acc
        return {k: float(v) for k, v in values.items() if v is not None}


def remapped_in_memory(drafter: Eagle3Drafter, own_map: VocabMap, training_map: VocabMap) -> Eagle3Drafter:
    """The same drafter with lm_head rows moved to the training map's positions (missing rows kept as they were)."""
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


def init_name(cfg: DictConfig) -> str:
    return getattr(cfg.init, "value", cfg.init)


def preflight(cfg: DictConfig, drafter: Eagle3Drafter, own_map: VocabMap | None, training_map: VocabMap,
              target: TargetModel | TargetHead, batch: dict[str, torch.Tensor]) -> Preflight:
    """Step-0 numbers of the init on one batch, beside the same drafter remapped; the guard then decides."""
    if own_map is None:
        with torch.no_grad():
            fresh = evaluate_batch(drafter, target, batch, cfg.ttt_steps, cfg.loss_mask)
        return Preflight(training_map.draft_vocab_size, training_map.draft_vocab_size,
                               training_map.draft_vocab_size, step0_acc=fresh["full_acc_0"],
                               step0_loss=fresh["loss_0"])
    checked = compare_with_training_map(own_map, training_map)
    trained_on_new_map = remapped_in_memory(drafter, own_map, training_map)
    with torch.no_grad():
        as_given = evaluate_batch(drafter, target, batch, cfg.ttt_steps, cfg.loss_mask)
        remapped = evaluate_batch(trained_on_new_map, target, batch, cfg.ttt_steps, cfg.loss_mask)
        as_is = remap_source_as_is(cfg, training_map, target, batch, device_of(drafter))
    result = Preflight(checked.positions_agree, checked.draft_vocab_size, checked.shared_ids,
                             step0_acc=as_given["full_acc_0"], step0_loss=as_given["loss_0"],
                             remapped_step0_acc=remapped["full_acc_0"],
                             as_is_step0_acc=as_is.get("full_acc_0"), as_is_step0_loss=as_is.get("loss_0"))
    if cfg.guard.enabled:
        check(result, init_name(cfg), cfg.guard.max_misaligned, cfg.guard.consent, cfg.drafter)
    return result


def remap_source_as_is(cfg: DictConfig, training_map: VocabMap, target: TargetModel | TargetHead,
                       batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """init=remap from a remap output: the step-0 numbers its source drafter would have had without the remap."""
    manifest = read_manifest(cfg.drafter) if init_name(cfg) == "remap" else None
    source = (manifest or {}).get("config", {}).get("drafter")
    if not source or not Path(source).exists():
        return {}
    unmapped = Eagle3Drafter.from_checkpoint(source, dtype=torch.float32, device=device)
    if unmapped.config.draft_vocab_size != training_map.draft_vocab_size:
        return {}
    unmapped.set_vocab_map(training_map)
    return evaluate_batch(unmapped, target, batch, cfg.ttt_steps, cfg.loss_mask)


def evaluate_batch(drafter: Eagle3Drafter, target: TargetModel | TargetHead, batch: dict[str, torch.Tensor],
                   ttt_steps: int, loss_mask: LossMask | str = LossMask.drafted) -> dict[str, float]:
    return run_ttt(drafter, target, batch, ttt_steps, loss_mask).metrics()


PREFLIGHT = "preflight"  # metrics.jsonl's split of the preflight line


def checked_once(cfg: DictConfig, drafter: Eagle3Drafter, own_map: VocabMap | None, training_map: VocabMap,
                 target: TargetModel | TargetHead, train_data: Rows, resumed_from: Path | None) -> dict[str, float]:
    """The preflight's figures, computed once per run by one rank where the drafter is (rank 0's first training
    batch), and read back from metrics.jsonl when a run resumes: the guard decided at the run's start, and a resume
    on a 1T target's node must not wait on it again. Rank 0 alone reads or computes them, and every rank gets its
    figures, or its refusal: the other ranks never read the log, which rank 0 rewrites as it resumes."""
    outcome: list[object] = [None]
    if int(os.environ.get("RANK", "0")) == 0:
        outcome[0] = logged_preflight(resumed_from) if resumed_from is not None else None
        if outcome[0] is None:
            first = next(micro_batches(train_data, cfg.micro_batch_size, 0, cfg.seed, 0, 1))
            try:
                outcome[0] = preflight(cfg, drafter, own_map, training_map, target, first).metrics()
            except RegraftError as refused:
                outcome[0] = refused
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], RegraftError):
        raise outcome[0]
    return outcome[0]


def logged_preflight(work: Path) -> dict[str, float] | None:
    """The preflight line a run wrote at its start (None: none kept)."""
    path = work / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        record = json.loads(line)
        if record.get("split") == PREFLIGHT:
            return {key: value for key, value in record.items() if key not in ("step", "split")}
    return None
