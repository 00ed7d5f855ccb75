"""Chat data as the target sees it: JSONL conversations rendered by the chat template, tokenized, and the
assistant tokens (the ones a drafter learns to predict) marked in a loss mask.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from stages.common.contract.errors import RegraftError

if TYPE_CHECKING:
    import torch


def read_chat_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(`path:line`, the parsed line) for each JSONL chat line, checked; a bad line stops with its file and line."""
    if not path.is_file():
        raise RegraftError(path, "chat data not found", "give data= a JSONL file of {\"messages\": [...]} lines")
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in record["messages"]):
                    raise TypeError("role and content must be strings")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise RegraftError(f"{path}:{number}", f"not a chat line ({exc.__class__.__name__}: {exc})",
                                   'each line must be {"messages": [{"role": ..., "content": ...}, ...]}') from exc
            yield f"{path}:{number}", record


def read_conversations(path: Path) -> Iterator[list[dict]]:
    """Yield the `messages` of each JSONL line; a bad line stops with its file and line number."""
    for _, record in read_chat_records(path):
        yield record["messages"]


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The target's tokenizer. trust_remote_code runs the tokenizer code in its folder (Kimi's is tiktoken-based)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise RegraftError(path, "tokenizer folder not found", "give tokenizer= a local HF tokenizer folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise RegraftError(path, "the tokenizer is code in its folder (auto_map)",
                           "set target.trust_remote_code=true (a stage alone: trust_remote_code=true) if you trust "
                           "it") from None
    if not tokenizer.chat_template:
        raise RegraftError(path, "tokenizer has no chat template", "add chat_template to tokenizer_config.json")
    return tokenizer


def render_with_assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the chat template renders it, and the character spans of its assistant turns.

    A turn's span is what rendering it adds to the prefix before it (with the generation prompt), so the
    assistant's end-of-turn marker counts and the header does not, whatever the template.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True) \
            if index else ""
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise RegraftError(tokenizer.name_or_path, "chat template is not prefix-stable, so assistant "
                               "turns cannot be located", "use a template that renders earlier turns unchanged")
        spans.append((len(before), len(through)))
    return text, spans


def assistant_token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    starts = offsets[:, 0] if len(offsets) else np.zeros(0, dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for begin, end in spans:
        mask |= (starts >= begin) & (starts < end)
    return mask


def batched(items: Iterator, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_chats(tokenizer, batch: list[list[dict]], max_length: int | None = None
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, assistant mask) per conversation: a fast tokenizer's offsets place every token in or out of an
    assistant span; a tokenizer without offsets (Kimi's tiktoken one) tokenizes the stretches between span
    boundaries one by one (`encode_by_spans`)."""
    rendered = [render_with_assistant_spans(tokenizer, messages) for messages in batch]
    if not tokenizer.is_fast:
        return [encode_by_spans(tokenizer, text, spans, max_length) for text, spans in rendered]
    encoded = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True,
                        truncation=max_length is not None, max_length=max_length)
    out = []
    for ids, offsets, (_, spans) in zip(encoded["input_ids"], encoded["offset_mapping"], rendered):
        mask = assistant_token_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)
        out.append((np.asarray(ids, dtype=np.int64), mask))
    return out


def encode_by_spans(tokenizer, text: str, spans: list[tuple[int, int]], max_length: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, assistant mask) of one rendered conversation, each stretch between span boundaries tokenized
    alone. The boundaries sit at a turn's end marker and after the assistant header's newline, where BPE never
    merges across, so this gives the ids of tokenizing the whole text (tests/test_chat.py checks it)."""
    cuts = sorted({0, len(text), *(bound for span in spans for bound in span)})
    ids: list[int] = []
    mask: list[bool] = []
    for begin, end in zip(cuts, cuts[1:]):
        piece = tokenizer.encode(text[begin:end], add_special_tokens=False)
        ids.extend(piece)
        mask.extend([any(first <= begin and end <= last for first, last in spans)] * len(piece))
    limit = max_length if max_length is not None else len(ids)
    return np.asarray(ids[:limit], dtype=np.int64), np.asarray(mask[:limit], dtype=bool)


def tokenized_chats(tokenizer, path: Path, max_length: int, batch_size: int = 256) -> dict[str, torch.Tensor]:
    """Every conversation of a JSONL file as fixed-length rows: input_ids, attention_mask and loss_mask [N, L].

    Rows are right-padded to `max_length` so every micro-batch has the same shape, which makes per-position means
    add up exactly across ranks and accumulation steps.
    """
    import torch

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = [row for batch in batched(read_conversations(path), batch_size)
            for row in encode_chats(tokenizer, batch, max_length)]
    if not rows:
        raise RegraftError(path, "holds no conversations", "give data= a JSONL file of chats")
    input_ids = torch.full((len(rows), max_length), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(rows), max_length), dtype=torch.bool)
    loss_mask = torch.zeros((len(rows), max_length), dtype=torch.bool)
    for index, (ids, mask) in enumerate(rows):
        input_ids[index, : len(ids)] = torch.from_numpy(ids)
        attention_mask[index, : len(ids)] = True
        loss_mask[index, : len(ids)] = torch.from_numpy(mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
