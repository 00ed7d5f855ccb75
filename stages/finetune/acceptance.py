"""Acceptance while a fine-tune trains (`finetune.eval_every`, and at the end): the drafter as it is (and the state the
stage keeps, once, where it was not measured), decoded against the hf target
by the probe's own greedy speculative decoder on a held-out slice of the eval sets (the conversations after the
probe's, in the probe's seeded order), and its accept_len pooled per set and over all sets, as the probe pools it.

Validation loss is scored against the training map, and a vocab or feature mismatch can hide there while acceptance
collapses (SpecForge PR #534); this is the figure regraft sells, measured on the way. Rank 0 decodes a copy of the
weights (gathered under ZeRO-3), the other ranks wait for its figures; the global random state is left as it was,
so a run with the measurement trains exactly as one without.

    probe = AcceptanceProbe(cfg, device)            # rank 0: tokenizer, prompts, stop ids
    measured = probe.measure(drafter_state, config)  # {"accept_len": 1.42, "accept_len/prose": ..., "seconds": ...}
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from stages.common.contract.errors import RegraftError
from stages.common.data.chat import load_tokenizer
from stages.common.data.chat_prompts import stop_ids
from stages.common.drafter.acceptance import accept_length, decoded_turns, load_eval_sets, per_set
from stages.common.drafter.config import DrafterConfig
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.drafter.spec_decode import SpeculativeDecoder
from stages.common.drafter.target import TargetModel

EVAL = "eval"  # metrics.jsonl's split of a measurement: `eval/accept_len`, `eval/accept_len/<set>` in MLflow


class AcceptanceProbe:
    """What a measurement needs, read once: the tokenizer, the held-out conversations, the stop ids, and (at the first
    measurement) the target, on `device` in the probe's dtype."""

    def __init__(self, cfg: DictConfig, device: torch.device):
        self.cfg, self.device, self.settings = cfg, device, cfg.acceptance
        self.tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
        self.conversations, self.sets = load_eval_sets(self.settings.sets, self.settings.prompts, self.settings.seed,
                                                       self.settings.skip)
        if not self.conversations:
            raise RegraftError("finetune.acceptance.sets", f"no conversation is left after the probe's "
                               f"{self.settings.skip} in any set", "give the eval sets more conversations, or set "
                               "finetune.eval_every=0")
        self.stops = stop_ids(self.tokenizer, Path(cfg.target))
        self.target: TargetModel | None = None

    def hf_target(self, config: DrafterConfig) -> TargetModel:
        if self.target is None:
            dtype = getattr(torch, self.settings.dtype)
            self.target = TargetModel.load(self.cfg.target, config.aux_layer_ids, config.aux_convention, dtype,
                                           self.cfg.trust_remote_code).to(self.device)
        return self.target

    def measure(self, state: dict[str, torch.Tensor], config: DrafterConfig) -> dict[str, float]:
        """accept_len of the drafter with `state`, pooled over all sets and per set, and the seconds it took."""
        started = time.perf_counter()
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            target = self.hf_target(config)
            with torch.device("meta"):
                drafter = Eagle3Drafter(config)
            drafter.load_state_dict(state, assign=True)
            drafter.to(self.device, next(target.model.parameters()).dtype)
            decoder = SpeculativeDecoder(target, drafter, self.settings.num_steps)
            rows = decoded_turns(decoder, self.conversations, self.tokenizer, self.settings.max_new_tokens, self.stops,
                                 desc=EVAL)
        figures = {key: value for key, value in per_set(rows, self.sets).items() if key.startswith("accept_len/")}
        return {"accept_len": accept_length(rows), **figures, "seconds": time.perf_counter() - started}
