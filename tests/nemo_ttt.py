"""NeMo Automodel 0.7.0's own EAGLE-3 TTT training forward on a drafter and batch regraft wrote; run by the
reference venv's python (make venv-ref), never imported by the tests:

    .venv-ref/bin/python tests/nemo_ttt.py CASE.pt RESULT.pt

CASE holds `family` (llama | mla), `config` (the HF config fields of NeMo's draft model), `state_dict` (in NeMo's
names), `selected` (the draft vocab's target ids) and the batch as NeMo's trainer takes it (shifted by
tests/test_families.py as NeMo's target.py shifts it). RESULT holds NeMo's per-step losses (its mean over the
positions it admits) and the per-step correct and admitted counts, read where NeMo's trainer computes them: the
masked soft cross-entropy it calls once per step (wrapped, so the figures are NeMo's own).
"""
from __future__ import annotations

import sys

import torch
import nemo_automodel.components.speculative.eagle.core as nemo_core
from nemo_automodel.components.speculative.eagle.core import Eagle3TrainerModule
from nemo_automodel.components.speculative.eagle.draft_deepseek import DeepseekV3Eagle3DraftModel
from nemo_automodel.components.speculative.eagle.draft_llama import LlamaEagle3DraftModel
from transformers import DeepseekV3Config, LlamaConfig

MODELS = {"llama": (LlamaEagle3DraftModel, LlamaConfig), "mla": (DeepseekV3Eagle3DraftModel, DeepseekV3Config)}


def nemo_drafter(case: dict) -> torch.nn.Module:
    model_class, config_class = MODELS[case["family"]]
    model = model_class(config_class(**case["config"], attn_implementation="eager")).to(torch.float32)
    missing, unexpected = model.load_state_dict(case["state_dict"], strict=False)
    if unexpected or [name for name in missing if name not in ("d2t", "t2d")]:
        raise SystemExit(f"state dict does not fit NeMo's model: missing {missing}, unexpected {unexpected}")
    model.set_vocab_mapping(case["selected"])
    return model


def per_step_figures(trainer: Eagle3TrainerModule, batch: dict) -> dict[str, torch.Tensor]:
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    nemo_loss = nemo_core.masked_soft_cross_entropy

    def recorded(logits, target_probs, position_mask):
        loss = nemo_loss(logits=logits, target_probs=target_probs, position_mask=position_mask)
        admitted = position_mask.squeeze(-1).bool()
        right = (logits.argmax(-1) == target_probs.argmax(-1)) & admitted
        steps.append((loss.detach(), right.sum(), admitted.sum()))
        return loss

    nemo_core.masked_soft_cross_entropy = recorded
    try:
        with torch.no_grad():
            out = trainer(**batch)
    finally:
        nemo_core.masked_soft_cross_entropy = nemo_loss
    losses, correct, admitted = (torch.stack(column) for column in zip(*steps))
    return {"step_losses": losses, "correct": correct, "admitted": admitted, "total_loss": out.loss.detach()}


def main(case_path: str, result_path: str) -> None:
    torch.use_deterministic_algorithms(True)
    case = torch.load(case_path, weights_only=False)
    drafter = nemo_drafter(case)
    mask = torch.zeros(case["config"]["vocab_size"], dtype=torch.bool)
    mask[case["selected"]] = True
    trainer = Eagle3TrainerModule(drafter, selected_token_ids=case["selected"], selected_token_mask=mask,
                                  ttt_steps=case["ttt_steps"])
    torch.save(per_step_figures(trainer, case["batch"]), result_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
