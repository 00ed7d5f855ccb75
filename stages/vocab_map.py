"""vocab_map stage: count the target's assistant tokens on chat data and build the draft vocabulary.

In: a target tokenizer folder (with a chat template) and chat JSONL (`{"messages": [...]}` per line).
Out: `vocab_map.safetensors` (`d2t` int64 [N], `t2d` bool [V], `token_counts` int64 [V]), `coverage.png`,
and `manifest.json` (sizes, token counts, coverage: the share of assistant tokens the draft vocab covers).

Only loss-masked tokens count: the assistant turns as the chat template renders them. The top N ids win, sorted
ascending, and `d2t[i] = target_id[i] - i`, as SpecForge, EAGLE and speculators build it. Ties break by lower id
and ids that never occur pad the set from the low end (speculators' rule; SpecForge breaks ties by first appearance
in its shuffled data, which no rerun reproduces, so regraft's map depends on the counts alone).

    python -m stages.vocab_map tokenizer=DIR data=FILE draft_vocab_size=N out=DIR
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from stages.common.contract.artifacts import staged_output
from stages.common.contract.stage import StageResult, stage_main
from stages.common.data.chat import batched, encode_chats, load_tokenizer, read_conversations
from stages.common.data.parts import part_manifests, part_slice
from stages.common.contract.errors import RegraftError
from stages.common.drafter.config import language_model_config
from stages.common.drafter.tensor_io import spec_of, write_safetensors
from stages.common.drafter.vocab import VOCAB_MAP_FILE, build_vocab_map


@dataclass
class TokenCounts:
    counts: torch.Tensor  # int64 [V], assistant tokens only
    conversations: int
    tokens_total: int


def count_assistant_tokens(tokenizer, conversations: Iterator[list[dict]], vocab_size: int, batch_size: int,
                           max_length: int | None = None) -> TokenCounts:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    seen = tokens_total = 0
    progress = tqdm(desc="vocab_map: counting", unit=" conv", mininterval=1.0)
    for batch in batched(conversations, batch_size):
        encoded = encode_chats(tokenizer, batch, max_length)
        masked = torch.from_numpy(np.concatenate([ids[mask] for ids, mask in encoded]))
        if masked.numel() and int(masked.max()) >= vocab_size:
            raise RegraftError(tokenizer.name_or_path, f"token id {int(masked.max())} >= vocab_size {vocab_size}",
                               "set vocab_size= to the target model's vocab size")
        counts.add_(torch.bincount(masked, minlength=vocab_size))
        seen += len(batch)
        tokens_total += sum(len(ids) for ids, _ in encoded)
        progress.update(len(batch))
    progress.close()
    return TokenCounts(counts, seen, tokens_total)


def conversations_of(data: Path, part: int | None, parts: int) -> Iterator[list[dict]]:
    """Part `part` of `parts` contiguous parts of the chats (all of them for None), read lazily."""
    if part is None:
        return read_conversations(data)
    chats = part_slice(sum(1 for _ in read_conversations(data)), part, parts, "vocab_map")
    return islice(read_conversations(data), chats.start, chats.stop)


def summed_counts(part_outputs: list[str], vocab_size: int) -> TokenCounts:
    """The parts' counts added up: what counting all their chats at once gives."""
    from safetensors.torch import load_file

    counts, conversations, tokens_total = torch.zeros(vocab_size, dtype=torch.int64), 0, 0
    for part, manifest in zip(part_outputs, part_manifests(part_outputs, "vocab_map")):
        part_counts = load_file(Path(part) / VOCAB_MAP_FILE)["token_counts"]
        if part_counts.shape[0] != vocab_size:
            raise RegraftError(part, f"counts {part_counts.shape[0]} ids, this map {vocab_size}",
                               "join parts counted with the same tokenizer and vocab_size")
        counts += part_counts
        conversations += manifest["metrics"]["conversations"]
        tokens_total += manifest["metrics"]["tokens_total"]
    return TokenCounts(counts, conversations, tokens_total)


def resolve_vocab_size(cfg_vocab_size: int | None, tokenizer, tokenizer_dir: Path) -> tuple[int, str]:
    if cfg_vocab_size:
        return int(cfg_vocab_size), "config"
    model_config = tokenizer_dir / "config.json"
    if model_config.exists():
        raw = language_model_config(json.loads(model_config.read_text()))
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
    tokenizer = load_tokenizer(tokenizer_dir, cfg.trust_remote_code)
    vocab_size, vocab_size_source = resolve_vocab_size(cfg.vocab_size, tokenizer, tokenizer_dir)
    if cfg.draft_vocab_size > vocab_size:
        raise RegraftError(f"draft_vocab_size={cfg.draft_vocab_size}", f"exceeds the target vocab ({vocab_size} ids, "
                           f"{vocab_size_source})", f"set draft_vocab_size= to at most {vocab_size}")
    if cfg.part_outputs:
        tally = summed_counts(list(cfg.part_outputs), vocab_size)
    else:
        tally = count_assistant_tokens(tokenizer, conversations_of(data, cfg.part, cfg.parts), vocab_size,
                                       cfg.batch_size, cfg.max_length)
    if tally.conversations == 0:
        raise RegraftError(data, "is empty", 'give data= a JSONL file with one {"messages": [...]} per line')
    assistant_tokens = int(tally.counts.sum())
    if assistant_tokens == 0 and cfg.max_length is not None:  # the preflight saw assistant turns: cut away here
        raise RegraftError(data, f"no assistant tokens in its {tally.conversations} conversations cut to "
                           f"max_length={cfg.max_length} tokens", "raise max_length: every assistant turn starts "
                           "past it")
    if assistant_tokens == 0:
        raise RegraftError(data, f"no assistant tokens in its {tally.conversations} conversations",
                           "the chats need assistant turns: only their tokens are counted")
    vocab_map = build_vocab_map(tally.counts, cfg.draft_vocab_size, str(data))
    distinct = int((tally.counts > 0).sum())
    if distinct < vocab_map.draft_vocab_size:
        print(f"warning: {data}: only {distinct} distinct assistant tokens, so {vocab_map.draft_vocab_size - distinct} "
              f"of the {vocab_map.draft_vocab_size} draft ids are padding that never occurs (fix: a smaller "
              "draft_vocab_size, or more data)", file=sys.stderr, flush=True)
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
        staged.update(metrics=metrics, vocab_size_source=vocab_size_source, part=cfg.part,
                      part_outputs=[str(Path(part).absolute()) for part in cfg.part_outputs],
                      inputs={"tokenizer": str(tokenizer_dir.absolute()), "data": str(data.absolute())})
    headline = (f"{vocab_map.draft_vocab_size} draft ids cover {metrics['coverage']:.1%} "
                f"of {assistant_tokens} assistant tokens")
    if metrics["padded_ids"]:
        headline += f"; {metrics['padded_ids']} ids padded (never seen)"
    return StageResult(Path(cfg.out), metrics, headline)


if __name__ == "__main__":
    raise SystemExit(stage_main("vocab_map", run))
