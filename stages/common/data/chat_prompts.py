"""Prompts for an engine that takes token ids (vLLM's offline engine): a chat rendered by the target's own chat
template with the generation prompt, as ids; the ids that end an answer; and the longest context the target takes.

Rendering here matches what an OpenAI-compatible server does with the same messages (template, then ids without
special tokens added), so the two engines are asked the same prompt.
"""
from __future__ import annotations

import json
from pathlib import Path


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def stop_ids(tokenizer, target_dir: Path) -> set[int]:
    """The tokenizer's eos and every eos id of the target's config.json (some list several)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = json.loads((Path(target_dir) / "config.json").read_text())
    eos = config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def context_length(target_dir: Path) -> int | None:
    """`max_position_embeddings` of the target's config.json (its text part for multimodal ones), if it says."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    length = (config.get("text_config") or config).get("max_position_embeddings")
    return int(length) if length else None
