"""The vocab_map stage's config (stages/vocab_map.py): the tokenizer, the chats, the draft vocab's size."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from stages.common.contract.stage import register_schema, setting


@dataclass
class VocabMapConfig:
    tokenizer: str = MISSING  # HF tokenizer folder of the target, with a chat template
    data: str = MISSING  # chat JSONL, one {"messages": [...]} per line
    out: str = MISSING
    draft_vocab_size: int = setting(32000, at_least=1)  # the field's default (Llama-3 and Kimi drafters); the toy world uses 1024
    vocab_size: Optional[int] = setting(None, at_least=1)  # target vocab; None: the tokenizer folder's config.json, else the tokenizer
    max_length: Optional[int] = setting(None, at_least=1)  # truncate each conversation to this many tokens, as training will
    batch_size: int = setting(256, at_least=1)  # conversations tokenized per batch
    trust_remote_code: bool = False  # run the tokenizer code in its folder (Kimi's tiktoken tokenizer needs it)
    # across nodes: the pipeline splits the chats into this many contiguous parts, each counted by a job of its own
    # (`part`), and a join (`part_outputs`) sums their counts and builds the map: the same map as counting at once
    parts: int = setting(1, at_least=1)
    part: Optional[int] = setting(None, at_least=0)  # this job's part of `parts`; None: all the chats
    part_outputs: list[str] = field(default_factory=list)  # join: complete part outputs whose token_counts are summed


register_schema("vocab_map", VocabMapConfig)
