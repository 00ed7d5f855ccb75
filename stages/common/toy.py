"""Small real artifacts for the built-in example and the tests: a byte-level BPE tokenizer with a chat template,
a tiny Llama target saved with `save_pretrained`, and a freshly initialised drafter for it.

Everything is built locally (no downloads) and written in the very formats real models use, so the stages
cannot tell a toy from the real thing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from stages.common.checkpoint import DrafterConfig, Layout, OUTPUT_OF_LAYER, default_aux_layer_ids
from stages.common.vocab import VocabMap

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """A byte-level BPE of `vocab_size` ids (special tokens first), saved as an HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|end|>",
                                   additional_special_tokens=SPECIAL_TOKENS[2:])
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def tiny_llama(tokenizer_dir: str | Path, out_dir: str | Path, hidden_size: int = 64, num_layers: int = 4,
               num_heads: int = 4, intermediate_size: int | None = None, tie_word_embeddings: bool = False,
               seed: int = 0) -> Path:
    """A randomly initialised Llama target over the tokenizer's vocab, saved with its tokenizer beside it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         intermediate_size=intermediate_size or 4 * hidden_size, max_position_embeddings=1024,
                         tie_word_embeddings=tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def toy_aux_layer_ids(num_layers: int) -> list[int]:
    """The field's [1, L//2-1, L-4] (outputs of layers) collapses below 8 layers; tiny targets spread them out."""
    if num_layers >= 8:
        return default_aux_layer_ids(num_layers, OUTPUT_OF_LAYER)
    return [0, num_layers // 2 - 1, num_layers - 2]


def drafter_config_for(target_dir: str | Path, draft_vocab_size: int, intermediate_size: int | None = None) -> DrafterConfig:
    """The config of a drafter for the target in `target_dir`: same width and heads, the field's aux layers."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    num_layers = int(target["num_hidden_layers"])
    layer = {
        "model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
        "hidden_size": target["hidden_size"], "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target.get("num_key_value_heads") or target["num_attention_heads"],
        "intermediate_size": intermediate_size or target["intermediate_size"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6), "rope_theta": target.get("rope_theta", 10000.0),
        "max_position_embeddings": target.get("max_position_embeddings", 2048), "vocab_size": target["vocab_size"],
    }
    return DrafterConfig(layer=layer, draft_vocab_size=draft_vocab_size,
                         aux_layer_ids=toy_aux_layer_ids(num_layers), aux_convention=OUTPUT_OF_LAYER,
                         target_num_layers=num_layers)


def fresh_drafter(target_dir: str | Path, vocab_map: VocabMap, out_dir: str | Path, layout: Layout = "sglang",
                  seed: int = 0) -> Path:
    from stages.common.eagle3 import Eagle3Drafter

    config = drafter_config_for(target_dir, vocab_map.draft_vocab_size)
    return Eagle3Drafter.initialised(config, vocab_map, seed).save(out_dir, layout)


def train_causal_lm(model_dir: str | Path, data: str | Path, out_dir: str | Path, steps: int, lr: float = 3e-3,
                    batch_size: int = 16, max_length: int = 128, seed: int = 0) -> Path:
    """Train a (tiny) causal LM on a chat JSONL with plain next-token loss and save it with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.common.chat import tokenized_chats

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    rows = tokenized_chats(tokenizer, Path(data), max_length)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        pick = torch.randint(0, rows["input_ids"].shape[0], (batch_size,), generator=generator)
        input_ids, attention = rows["input_ids"][pick], rows["attention_mask"][pick]
        labels = input_ids.masked_fill(~attention, -100)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = Path(out_dir)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
