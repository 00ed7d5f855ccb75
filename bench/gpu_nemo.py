"""bench/gpu.py's field trainer: NeMo Automodel 0.7.0's EAGLE-3 TTT step (its Eagle3TrainerModule, forward and
backward) on random weights and states of the shape bench/gpu.py gives, timed as bench/gpu.py times regraft's.
Run by the reference venv's python (make venv-ref), never imported:

    .venv-ref/bin/python bench/gpu_nemo.py CASE.json      # prints one JSON line: seconds, tokens_s, peak_gib
"""
from __future__ import annotations

import json
import sys

import torch
from nemo_automodel.components.speculative.eagle.core import Eagle3TrainerModule
from nemo_automodel.components.speculative.eagle.draft_deepseek import DeepseekV3Eagle3DraftModel
from nemo_automodel.components.speculative.eagle.draft_llama import LlamaEagle3DraftModel
from transformers import DeepseekV3Config, LlamaConfig

from gpu import timed  # bench/gpu.py, beside this file: the same timing for both trainers

MODELS = {"llama": (LlamaEagle3DraftModel, LlamaConfig), "mla": (DeepseekV3Eagle3DraftModel, DeepseekV3Config)}


def main(case_path: str) -> None:
    case = json.load(open(case_path))
    sizes, seq, device = case["sizes"], case["seq"], case["device"]
    family = "mla" if case["family"].startswith("mla") else "llama"
    fields = {k: v for k, v in case["layer"].items() if k not in ("model_type", "num_hidden_layers")}
    fields.update(draft_vocab_size=sizes["draft_vocab"], target_hidden_size=sizes["hidden"], num_aux_hidden_states=3,
                  fc_norm=case["family"].endswith("3.1"), norm_output=case["family"].endswith("3.1"),
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    model_class, config_class = MODELS[family]
    torch.manual_seed(0)
    model = model_class(config_class(**fields, attn_implementation="eager")).to(device, torch.bfloat16)
    selected = torch.randperm(sizes["target_vocab"])[: sizes["draft_vocab"]].sort().values
    model.set_vocab_mapping(selected)
    mask = torch.zeros(sizes["target_vocab"], dtype=torch.bool)
    mask[selected] = True
    trainer = Eagle3TrainerModule(model, selected_token_ids=selected.to(device), selected_token_mask=mask.to(device),
                                  ttt_steps=case["ttt_steps"])
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, sizes["target_vocab"], (1, seq), generator=generator).to(device),
             "attention_mask": torch.ones(1, seq, dtype=torch.long, device=device),
             "loss_mask": torch.ones(1, seq, dtype=torch.long, device=device),
             "aux_hidden_states": torch.randn(1, seq, 3 * sizes["hidden"], generator=generator).to(device,
                                                                                                   torch.bfloat16),
             "target_logits": torch.randn(1, seq, sizes["target_vocab"], generator=generator).to(device,
                                                                                               torch.bfloat16)}

    def step() -> None:
        trainer(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    print(json.dumps(timed(step, case["steps"], seq, device)))

if __name__ == "__main__":
    main(sys.argv[1])
