"""Prompts for an engine that takes token ids (vLLM's offline engine): a chat rendered by the target's own chat
template with the generation prompt, as ids; the ids that end an answer; and the longest context the target takes.

Rendering here matches what an OpenAI-compatible server does with the same messages (template, then ids without
special tokens added), so the two engines are asked the same prompt.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from stages.common.contract.errors import RegraftError
from stages.common.drafter.config import target_config


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
    length = target_config(target_dir).get("max_position_embeddings")
    return int(length) if length else None


@dataclass
class EvalSet:
    """One workload the probe measures on its own: its name (`accept_len/<name>`) and a chat JSONL whose user turns
    are asked, or `builtin`. A list of these, not a name -> path mapping: Hydra merges a mapping given on the command
    line into the default one, and replaces a list, which is what a user giving their own sets means."""

    name: str = MISSING
    path: str = MISSING


def check_eval_sets(sets: list, key: str) -> None:
    names = [entry.name for entry in sets]
    if not names:
        raise RegraftError(f"{key}=[]", "no prompts to ask",
                           f"set {key}='[{{name: chat, path: chats.jsonl}}]' (or path: builtin)")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise RegraftError(f"{key}", f"names {', '.join(repeated)} more than once", "give every eval set its own name")
    if any("/" in name for name in names):
        raise RegraftError(f"{key}", "a set's name holds '/', which would split its metric names",
                           "name the sets without '/'")
