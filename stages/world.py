"""world stage: the built-in example world, a miniature of the real situation regraft exists for.

Out: `tokenizer/` (byte-level BPE with a chat template), `target/` (a tiny Llama saved with `save_pretrained`),
`data_a.jsonl` and `data_b.jsonl` (stdlib docstrings as chats, two domains), `drafter_a/` (a drafter carrying the
draft vocab built from domain A, so its ordering differs from the one built for B, as in the real case), and
`manifest.json`. The target and drafter weights are freshly initialised here; trained ones come with the
finetune stage. Deterministic for a seed.

    python -m stages.world out=DIR
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING, DictConfig

from stages.common.artifacts import staged_output
from stages.common.cli import StageResult, register_schema, stage_main
from stages.common.corpus import as_conversation, stdlib_docstrings, write_jsonl
from stages.common.errors import RegraftError
from stages.common.toy import fresh_drafter, tiny_llama, train_tokenizer
from stages.common.chat import load_tokenizer, read_conversations
from stages.vocab_map import build_vocab_map, count_assistant_tokens


@dataclass
class WorldConfig:
    out: str = MISSING
    seed: int = 0
    max_docs: int = 3000  # docstrings to use, split between the two domains
    tokenizer_vocab_size: int = 4096
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    draft_vocab_size: int = 1024


register_schema("world", WorldConfig)


def run(cfg: DictConfig) -> StageResult:
    docs = list(stdlib_docstrings())
    random.Random(cfg.seed).shuffle(docs)
    docs = docs[: cfg.max_docs]
    if not docs:
        raise RegraftError(None, "found no stdlib docstrings", "run with a CPython that ships its .py sources")
    with staged_output(cfg.out, "world", cfg) as staged:
        root = staged.path
        for domain in ("a", "b"):
            rows = [as_conversation(doc, i) for i, doc in enumerate(docs) if doc.domain == domain]
            write_jsonl(rows, root / f"data_{domain}.jsonl")
        texts = [doc.text for doc in docs] + [m["content"] for doc in docs[:200]
                                              for m in as_conversation(doc, 0)["messages"]]
        tokenizer_dir = train_tokenizer(texts, cfg.tokenizer_vocab_size, root / "tokenizer")
        target = tiny_llama(tokenizer_dir, root / "target", cfg.hidden_size, cfg.num_layers, cfg.num_heads,
                            seed=cfg.seed)
        tokenizer = load_tokenizer(target)
        tally = count_assistant_tokens(tokenizer, read_conversations(root / "data_a.jsonl"), len(tokenizer), 256)
        map_a = build_vocab_map(tally.counts, cfg.draft_vocab_size, "data_a.jsonl")
        fresh_drafter(target, map_a, root / "drafter_a", seed=cfg.seed)
        metrics = {"docs_a": sum(d.domain == "a" for d in docs), "docs_b": sum(d.domain == "b" for d in docs),
                   "vocab_size": len(tokenizer)}
        staged.update(metrics=metrics)
    return StageResult(Path(cfg.out), metrics, f"{len(docs)} docstrings, vocab {len(tokenizer)}")


if __name__ == "__main__":
    raise SystemExit(stage_main("world", run))
