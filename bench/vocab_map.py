"""Benchmark: how fast the vocab_map stage counts assistant tokens, against tokenizing alone and a Counter loop.

What it measures, in tokens per second over the same chat data:

  tokenize   the tokenizer's batch call (with offsets) on the already rendered chat texts: the floor
  regraft    stages.vocab_map.count_assistant_tokens: read the JSONL, render the chat template (and the
             assistant spans), tokenize, mask the assistant tokens, torch.bincount
  counter    the same reading, rendering and tokenizing, then the mask and a collections.Counter in Python
  (and, for reference, the reading and chat-template rendering alone, which both counting methods include)

The data is built locally: docstrings of the Python standard library (parsed with ast, nothing imported) become
conversations {"user": "What does X do?", "assistant": <docstring>} in a JSONL file, and a byte-level BPE of
~4096 ids (stages.world.toy.train_tokenizer, with the toy chat template) is trained on them. The Counter's
counts must equal regraft's exactly (asserted). Each method runs --repeat times; the table shows the fastest.

    .venv/bin/python bench/vocab_map.py
    .venv/bin/python bench/vocab_map.py --conversations 2000 --repeat 1
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `stages` is importable
from stages.common.contract.runtime import set_process_defaults  # noqa: E402

set_process_defaults()
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from stages.world.toy import train_tokenizer  # noqa: E402
from stages.common.data.chat import load_tokenizer, read_conversations, render_with_assistant_spans  # noqa: E402
from stages.vocab_map import count_assistant_tokens  # noqa: E402

MIN_DOCSTRING_CHARS = 40


# ---------------------------------------------------------------- data


def stdlib_docstrings() -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of every module, class and function in the stdlib sources, in file order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts)
        yield from _docstrings(tree, module)


def _docstrings(node: ast.AST, name: str) -> Iterator[tuple[str, str]]:
    doc = ast.get_docstring(node, clean=True)
    if doc and len(doc) >= MIN_DOCSTRING_CHARS:
        yield name, doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _docstrings(child, f"{name}.{child.name}")


def write_conversations(pairs: list[tuple[str, str]], path: Path) -> None:
    with path.open("w") as out:
        for name, doc in pairs:
            messages = [{"role": "user", "content": f"What does {name} do?"},
                        {"role": "assistant", "content": doc}]
            out.write(json.dumps({"messages": messages}) + "\n")


# ---------------------------------------------------------------- the three methods


def tokenize_only(tokenizer, texts: list[str], batch_size: int) -> int:
    """Tokens produced by the batch call alone (the texts are rendered beforehand)."""
    tokens = 0
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer(texts[start:start + batch_size], add_special_tokens=False, return_offsets_mapping=True)
        tokens += sum(len(ids) for ids in encoded["input_ids"])
    return tokens


def regraft_counts(tokenizer, data: Path, vocab_size: int, batch_size: int):
    return count_assistant_tokens(tokenizer, read_conversations(data), vocab_size, batch_size)


def counter_counts(tokenizer, data: Path, batch_size: int) -> Counter:
    """Render and tokenize as regraft does, then mask and count in plain Python."""
    counts: Counter = Counter()

    def flush(batch: list[tuple[str, list[tuple[int, int]]]]) -> None:
        encoded = tokenizer([text for text, _ in batch], add_special_tokens=False, return_offsets_mapping=True)
        for ids, offsets, (_, spans) in zip(encoded["input_ids"], encoded["offset_mapping"], batch):
            counts.update(i for i, (start, _) in zip(ids, offsets) if any(b <= start < e for b, e in spans))

    batch = []
    for messages in read_conversations(data):
        batch.append(render_with_assistant_spans(tokenizer, messages))
        if len(batch) == batch_size:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    return counts


def render_only(tokenizer, data: Path) -> int:
    """Just the chat-template rendering (text and assistant spans) that both counting methods do."""
    return sum(len(render_with_assistant_spans(tokenizer, messages)[0]) for messages in read_conversations(data))


def best_of(repeat: int, fn, *args):
    """(fastest seconds, result of the last call)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn(*args)
        best = min(best, time.perf_counter() - start)
    return best, result


# ---------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4000, help="how many docstrings become conversations")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocab of the toy tokenizer")
    parser.add_argument("--batch-size", type=int, default=256, help="conversations per tokenizer call (the stage's)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per method; the fastest is shown")
    parser.add_argument("--workdir", type=Path, default=ROOT / "outputs" / "bench",
                        help="a temp folder is made under it (default: outputs/bench)")
    parser.add_argument("--keep", action="store_true", help="keep the tokenizer and JSONL")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="vocab_map-", dir=args.workdir))
    try:
        start = time.perf_counter()
        every = list(stdlib_docstrings())
        pairs = every[:: max(1, len(every) // args.conversations)][: args.conversations]  # spread over the stdlib
        data = root / "chat.jsonl"
        write_conversations(pairs, data)
        train_tokenizer((doc for _, doc in pairs), args.vocab_size, root / "tokenizer")
        tokenizer = load_tokenizer(root / "tokenizer")
        vocab_size = len(tokenizer)
        texts = [render_with_assistant_spans(tokenizer, messages)[0] for messages in read_conversations(data)]
        setup = time.perf_counter() - start

        render_s, _ = best_of(args.repeat, render_only, tokenizer, data)
        tokenize_s, tokens = best_of(args.repeat, tokenize_only, tokenizer, texts, args.batch_size)
        regraft_s, tally = best_of(args.repeat, regraft_counts, tokenizer, data, vocab_size, args.batch_size)
        counter_s, counter = best_of(args.repeat, counter_counts, tokenizer, data, args.batch_size)

        from_counter = torch.zeros(vocab_size, dtype=torch.int64)
        for token_id, count in counter.items():
            from_counter[token_id] = count
        assert torch.equal(from_counter, tally.counts), "Counter and regraft counts differ"
        assert tally.tokens_total == tokens, (tally.tokens_total, tokens)
        assistant = int(tally.counts.sum())

        console.print(f"data: {len(pairs)} conversations from {len(every)} stdlib docstrings "
                      f"(>= {MIN_DOCSTRING_CHARS} chars), {data.stat().st_size / 1e6:.1f} MB JSONL, "
                      f"{sum(map(len, texts)) / 1e6:.1f} M chars rendered; tokenizer: {vocab_size} ids; "
                      f"built in {setup:.0f} s")
        console.print(f"tokens: {tokens:,} in all, {assistant:,} assistant ({assistant / tokens:.1%}), "
                      f"{int((tally.counts > 0).sum())} distinct assistant ids; batch size {args.batch_size}; "
                      f"TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}; best of {args.repeat}")
        table = Table(title="vocab_map counting benchmark")
        for column in ("method", "seconds", "tokens/s", "assistant tokens/s", "vs tokenize"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for name, seconds in (("tokenize (rendered texts, offsets)", tokenize_s),
                              ("regraft count_assistant_tokens", regraft_s),
                              ("collections.Counter", counter_s),
                              ("(for reference) read + render template only", render_s)):
            table.add_row(name, f"{seconds:.3f}", f"{tokens / seconds:,.0f}", f"{assistant / seconds:,.0f}",
                          f"{seconds / tokenize_s:.2f}x")
        console.print(table)
        console.print("counts identical: Counter == regraft on all "
                      f"{vocab_size} ids ({assistant:,} assistant tokens)")
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
