"""A miniature of Kimi-K2.5 and of the Kimi line's drafter, in their real formats, for the dress rehearsal of
`experiment=kimi_k25` (tests/test_rehearsal.py, bench/rehearsal.py).

- The target: Kimi-K2.5's folder layout. config.json is the multimodal wrapper (`KimiK25ForConditionalGeneration`,
  model_type `kimi_k25`, the language model's fields in `text_config` with model_type `kimi_k2`, a MoonViT
  `vision_config`), model.safetensors names tensors as the released checkpoint does (`language_model.model.layers.*`,
  `language_model.lm_head.weight`, `vision_tower.encoder.blocks.*`, `mm_projector.proj.*`), the language model is
  DeepSeek-V3 (MLA and MoE) trained briefly on the world's chats, and the tokenizer is the tiktoken stand-in
  (tests/tiktoken_standin.py: remote code, no offsets) with Kimi's media tokens after its ranks. There is no remote
  model code: transformers >= 5.25 and vLLM read this layout with their own classes, as they read the real one.
- The source drafter: an MLA-backbone EAGLE-3 drafter (`Eagle3DeepseekV2ForCausalLM`, the Kimi line's format), its
  aux ids computed from the target's depth as the Kimi drafters' are (input of layer [2, L//2, L-3]) and its draft
  vocab counted on other data than the rehearsal's, so remap has rows to move.

The MLA widths are DeepSeek's (kv_lora_rank 512, qk_rope_head_dim 64): vLLM's CPU MLA kernel takes head size 576
only. Everything else is small.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from stages.common.drafter.config import INPUT_OF_LAYER, DrafterConfig
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.drafter.vocab import VocabMap
from stages.world import toy
from tests import tiktoken_standin

MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
NUM_LAYERS = 8  # aux ids [2, 4, 5] input of layer, as [2, 30, 58] are for Kimi-K2.5's 61 layers
HIDDEN = 64
VISION = {"patch_size": 14, "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32,
          "intermediate_size": 64}
# Kimi-K2.5's preprocessor_config.json, its media settings as released (vLLM builds its image processor from it even
# when it serves the language model only).
MEDIA_PROC = {"in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
              "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
              "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
              "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig"}


def kimi_aux_layer_ids(num_layers: int) -> list[int]:
    """The Kimi drafters' aux ids for a target of `num_layers` (input of layer: [2, 30, 58] for 61)."""
    return [2, num_layers // 2, num_layers - 3]


def original_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' save_pretrained of Kimi_K25ForConditionalGeneration writes a few names the released checkpoint
    does not have (its reverse of the vision renames also turns the language model's `layers` into `blocks`):
    put them back to the checkpoint's own, the names vLLM's loader reads."""
    def rename(name: str) -> str:
        name = name.replace("language_model.model.blocks.", "language_model.model.layers.")
        name = name.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
        return name.removeprefix("model.") if name.startswith("model.mm_projector.") else name
    return {rename(name): tensor for name, tensor in state.items()}


def wrap_as_kimi_k25(text_dir: Path, tokenizer_dir: Path, out: Path) -> Path:
    """A trained DeepSeek-V3 folder re-saved in Kimi-K2.5's layout (its vision tower random and tiny)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.kimi_k25 import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = DeepseekV3ForCausalLM.from_pretrained(text_dir)
    config = Kimi_K25Config(text_config=text.config.to_dict(), vision_config=VISION, projection_hidden_size=32,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    save_file(original_names(load_file(weights)), weights, metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["architectures"] = ["KimiK25ForConditionalGeneration"]
    raw["text_config"]["model_type"] = "kimi_k2"
    tokenizer = tiktoken_standin.build(tokenizer_dir, out, toy.SPECIAL_TOKENS, added=MEDIA_TOKENS)
    specials = json.loads((tokenizer / "tokenizer_config.json").read_text())["special_token_ids"]
    raw["image_token_id"] = raw["media_placeholder_token_id"] = specials["<|media_pad|>"]  # the release has both
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC}, indent=1))
    return out


def build_target(tokenizer_dir: Path, chats: Path, out: Path, steps: int = 60) -> Path:
    """The miniature Kimi-K2.5 in `out`, its language model trained `steps` steps on `chats`."""
    work = out.parent / f"{out.name}.build"
    vocab = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]) + len(MEDIA_TOKENS)
    raw = toy.tiny_deepseek_v3(tokenizer_dir, work / "raw", hidden_size=HIDDEN, num_layers=NUM_LAYERS,
                               vocab_size=vocab)
    trained = toy.train_causal_lm(raw, chats, work / "trained", steps=steps, lr=1e-3, max_length=64)
    return wrap_as_kimi_k25(trained, tokenizer_dir, out)


def build_source_drafter(target_dir: Path, out: Path, draft_vocab_size: int = 256, seed: int = 1) -> Path:
    """A Kimi-line MLA drafter for the miniature: one MLA layer at the target's width, head size 576 as vLLM's CPU
    kernel takes, random weights and a draft vocab of `draft_vocab_size` ids drawn with `seed` (its own ordering,
    not the rehearsal's counts)."""
    text = json.loads((target_dir / "config.json").read_text())["text_config"]
    layer = {"model_type": "deepseek_v2", "hidden_size": text["hidden_size"], "intermediate_size": 4 * HIDDEN,
             "num_attention_heads": text["num_attention_heads"], "num_key_value_heads": text["num_attention_heads"],
             "vocab_size": text["vocab_size"], "num_hidden_layers": 1, "rms_norm_eps": text["rms_norm_eps"],
             "rope_theta": 10000.0, "max_position_embeddings": text["max_position_embeddings"], "hidden_act": "silu",
             "q_lora_rank": text["q_lora_rank"], "kv_lora_rank": text["kv_lora_rank"],
             "qk_nope_head_dim": text["qk_nope_head_dim"], "qk_rope_head_dim": text["qk_rope_head_dim"],
             "v_head_dim": text["v_head_dim"]}
    generator = torch.Generator().manual_seed(seed)
    selected = torch.randperm(text["vocab_size"], generator=generator)[:draft_vocab_size].sort().values
    t2d = torch.zeros(text["vocab_size"], dtype=torch.bool)
    t2d[selected] = True
    config = DrafterConfig(layer=layer, draft_vocab_size=draft_vocab_size, target_hidden_size=text["hidden_size"],
                           aux_layer_ids=kimi_aux_layer_ids(text["num_hidden_layers"]), aux_convention=INPUT_OF_LAYER,
                           target_num_layers=text["num_hidden_layers"])
    vocab_map = VocabMap(selected - torch.arange(draft_vocab_size), t2d, source="kimi miniature")
    drafter = Eagle3Drafter.initialised(config, vocab_map, seed=seed)
    return drafter.save(out)
