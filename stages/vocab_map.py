"""vocab_map stage: count the target's assistant tokens on chat data and build the draft vocabulary.

In: a target tokenizer folder (with a chat template) and chat JSONL (`{"messages": [...]}` per line).
Out: `vocab_map.safetensors` (`d2t` int64 [N], `t2d` bool [V], `token_counts` int64 [V]), `coverage.png`,
and `manifest.json` (sizes, token counts, coverage: the share of assistant tokens the draft vocab covers).

Only loss-masked tokens count: the assistant turns as the chat template renders them. The top N ids win
(ties: lower id first; ids that never occur pad the set from the low end), sorted ascending, and
`d2t[i] = target_id[i] - i`, exactly as SpecForge, EAGLE and speculators build it.

    python -m stages.vocab_map tokenizer=DIR data=FILE draft_vocab_size=N out=DIR
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from omegaconf import MISSING, DictConfig
from tqdm import tqdm

from stages.common.artifacts import staged_output
from stages.common.cli import StageResult, register_schema, stage_main
from stages.common.errors import RegraftError
from stages.common.tensor_io import spec_of, write_safetensors
from stages.common.vocab import VOCAB_MAP_FILE, VocabMap


@dataclass
class VocabMapConfig:
    tokenizer: str = MISSING  # HF tokenizer folder of the target, with a chat template
    data: str = MISSING  # chat JSONL, one {"messages": [...]} per line
    out: str = MISSING
    draft_vocab_size: int = 32000
    vocab_size: Optional[int] = None  # target vocab; None: the tokenizer folder's config.json, else the tokenizer
    max_length: Optional[int] = None  # truncate each conversation to this many tokens, as training will
    batch_size: int = 256


register_schema("vocab_map", VocabMapConfig)


def read_conversations(path: Path) -> Iterator[list[dict]]:
    """Yield the `messages` of each JSONL line; a bad line stops with its file and line number."""
    if not path.exists():
        raise RegraftError(path, "chat data not found", "give data= a JSONL file of {\"messages\": [...]} lines")
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                if not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages):
                    raise TypeError("role and content must be strings")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise RegraftError(f"{path}:{number}", f"not a chat line ({exc.__class__.__name__}: {exc})",
                                   'each line must be {"messages": [{"role": ..., "content": ...}, ...]}') from exc
            yield messages


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise RegraftError(path, "tokenizer folder not found", "give tokenizer= a local HF tokenizer folder")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise RegraftError(path, "tokenizer has no chat template", "add chat_template to tokenizer_config.json")
    if not tokenizer.is_fast:
        raise RegraftError(path, "needs a fast tokenizer (offsets mark the assistant tokens)",
                           "save the tokenizer with tokenizer.json")
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


@dataclass
class TokenCounts:
    counts: torch.Tensor  # int64 [V], assistant tokens only
    conversations: int
    tokens_total: int


def count_assistant_tokens(tokenizer, conversations: Iterator[list[dict]], vocab_size: int, batch_size: int,
                           max_length: int | None = None) -> TokenCounts:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    conversations_seen = tokens_total = 0
    progress = tqdm(desc="vocab_map: counting", unit=" conv", mininterval=1.0)

    def flush(batch: list[tuple[str, list[tuple[int, int]]]]) -> None:
        nonlocal tokens_total
        encoded = tokenizer([text for text, _ in batch], add_special_tokens=False, return_offsets_mapping=True,
                            truncation=max_length is not None, max_length=max_length)
        kept = []
        for ids, offsets, (_, spans) in zip(encoded["input_ids"], encoded["offset_mapping"], batch):
            ids = np.asarray(ids, dtype=np.int64)
            kept.append(ids[assistant_token_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans)])
            tokens_total += len(ids)
        masked = torch.from_numpy(np.concatenate(kept))
        if masked.numel() and int(masked.max()) >= vocab_size:
            raise RegraftError(tokenizer.name_or_path, f"token id {int(masked.max())} >= vocab_size {vocab_size}",
                               "set vocab_size= to the target model's vocab size")
        counts.add_(torch.bincount(masked, minlength=vocab_size))
        progress.update(len(batch))

    batch: list[tuple[str, list[tuple[int, int]]]] = []
    for messages in conversations:
        batch.append(render_with_assistant_spans(tokenizer, messages))
        conversations_seen += 1
        if len(batch) == batch_size:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    progress.close()
    return TokenCounts(counts, conversations_seen, tokens_total)


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int, source: str = "<counts>") -> VocabMap:
    """Top-N ids by count (a stable sort puts lower ids first among ties and pads with unseen low ids)."""
    if draft_vocab_size > counts.numel():
        raise RegraftError(source, f"draft_vocab_size {draft_vocab_size} exceeds the target vocab {counts.numel()}",
                           "choose a smaller draft_vocab_size")
    chosen = torch.sort(counts, descending=True, stable=True).indices[:draft_vocab_size]
    return VocabMap.from_target_ids(chosen.sort().values, counts.numel(), token_counts=counts, source=source)


def resolve_vocab_size(cfg_vocab_size: int | None, tokenizer, tokenizer_dir: Path) -> tuple[int, str]:
    if cfg_vocab_size:
        return int(cfg_vocab_size), "config"
    model_config = tokenizer_dir / "config.json"
    if model_config.exists():
        raw = json.loads(model_config.read_text())
        raw = raw.get("text_config") or raw
        if "vocab_size" in raw:
            return int(raw["vocab_size"]), str(model_config)
    return len(tokenizer), "tokenizer"


def save_coverage_plot(counts: torch.Tensor, draft_vocab_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranked = torch.sort(counts, descending=True).values
    cumulative = (ranked.cumsum(0).double() / max(int(ranked.sum()), 1)).numpy()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(np.arange(1, len(cumulative) + 1), cumulative)
    ax.axvline(draft_vocab_size, color="tab:red", linestyle="--", label=f"draft vocab N={draft_vocab_size}")
    ax.set_xscale("log")
    ax.set_xlabel("top-N target ids")
    ax.set_ylabel("share of assistant tokens")
    ax.set_title("draft vocab coverage")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: DictConfig) -> StageResult:
    tokenizer_dir, data = Path(cfg.tokenizer), Path(cfg.data)
    tokenizer = load_tokenizer(tokenizer_dir)
    vocab_size, vocab_size_source = resolve_vocab_size(cfg.vocab_size, tokenizer, tokenizer_dir)
    tally = count_assistant_tokens(tokenizer, read_conversations(data), vocab_size, cfg.batch_size, cfg.max_length)
    assistant_tokens = int(tally.counts.sum())
    if assistant_tokens == 0:
        raise RegraftError(data, "no assistant tokens found", "the data needs assistant turns to count")
    vocab_map = build_vocab_map(tally.counts, cfg.draft_vocab_size, str(data))
    distinct = int((tally.counts > 0).sum())
    metrics = {
        "draft_vocab_size": vocab_map.draft_vocab_size, "vocab_size": vocab_size,
        "conversations": tally.conversations, "tokens_total": tally.tokens_total,
        "assistant_tokens": assistant_tokens, "distinct_assistant_tokens": distinct,
        "padded_ids": max(0, vocab_map.draft_vocab_size - distinct),
        "coverage": float(tally.counts[vocab_map.target_ids].sum()) / assistant_tokens,
    }
    with staged_output(cfg.out, "vocab_map", cfg) as staged:
        write_safetensors(staged.path / VOCAB_MAP_FILE, [spec_of("d2t", vocab_map.d2t), spec_of("t2d", vocab_map.t2d),
                          spec_of("token_counts", tally.counts)], metadata={"format": "pt"})
        save_coverage_plot(tally.counts, vocab_map.draft_vocab_size, staged.path / "coverage.png")
        staged.update(metrics=metrics, vocab_size_source=vocab_size_source,
                      inputs={"tokenizer": str(tokenizer_dir.absolute()), "data": str(data.absolute())})
    headline = (f"{vocab_map.draft_vocab_size} draft ids cover {metrics['coverage']:.1%} "
                f"of {assistant_tokens} assistant tokens")
    return StageResult(Path(cfg.out), metrics, headline)


if __name__ == "__main__":
    raise SystemExit(stage_main("vocab_map", run))
