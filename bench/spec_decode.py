"""Benchmark: tok/s of plain greedy decoding against greedy EAGLE-3 speculative decoding (hf backend) on CPU.

The world is built here with the project's own code, no downloads: a BPE tokenizer, tiny Llama targets (4 layers,
hidden 64 and 256) trained on chats whose answers cycle through six words, and a good drafter for each, trained by
the finetune stage (`init=scratch`). Every speculative answer is checked token for token against plain greedy, as
the probe does (`lossless`). Beside the measured speedup stands its bound from the parts:

    bound = accept_len x (ms per plain forward) / (ms per verify forward + num_steps x ms per draft forward)

where the parts are timed alone, taken in turn (the median of `--forward-calls` calls each), on caches as long as an
answer's middle: a plain forward reads 1 token, a verify forward num_steps + 1, and a draft forward is the decoder's
own draft round (the feed of one verified token, then num_steps - 1 steps) divided by num_steps. The bound leaves
out the prefill and the Python between calls, so a measured speedup can land a little on either side of it.
Timings are the fastest of `--repeat` passes, as other jobs share the CPUs; the caption gives the load average.
`--decode-threads 0` decodes with torch's own intra-op thread count, as the decoder did before it pinned one thread
(stages/common/drafter/spec_decode.py). Building the world takes about 12 minutes on 2 CPUs, measuring 3; `--workdir` keeps
it for the next run.

    .venv/bin/python bench/spec_decode.py [--num-steps 1 3 5] [--max-new-tokens 64] [--prompts 6] [--repeat 3]
                                          [--sizes 64 256] [--decode-threads 1] [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from stages.common.contract.runtime import set_process_defaults  # noqa: E402

set_process_defaults()

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from stages import finetune, vocab_map  # noqa: E402
from stages.common.drafter import spec_decode  # noqa: E402
from stages.world import toy  # noqa: E402
from stages.common.data.chat import load_tokenizer  # noqa: E402
from stages.common.contract.stage import compose_stage  # noqa: E402
from stages.common.drafter.eagle3 import Eagle3Drafter, KVCache  # noqa: E402
from stages.common.drafter.spec_decode import (  # noqa: E402
    SpeculativeDecoder, crop, decoding, greedy_generate, target_forward)
from stages.common.drafter.target import TargetModel  # noqa: E402
from stages.probe import chat_renderer, drafter_dir, first_difference, stop_ids  # noqa: E402

SIZES = {"toy (hidden 64)": 64, "wide (hidden 256)": 256}
USER_WORDS = "alpha bravo charlie kilo lima mike".split()
ANSWER_WORDS = "zulu yankee xray whiskey victor uniform".split()
ANSWER_LENGTH, MAX_LENGTH, DRAFT_VOCAB = 40, 64, 64
TARGET_STEPS, TTT_STEPS, DRAFTER_EPOCHS = 150, 5, 3


# ---------------------------------------------------------------- the world


def write_chats(path: Path, count: int = 96, seed: int = 0) -> Path:
    """Chats whose answers run round the six-word cycle from a random start: a target learns them, so does a drafter."""
    rng, lines = random.Random(seed), []
    for _ in range(count):
        start = rng.randrange(len(ANSWER_WORDS))
        answer = " ".join(ANSWER_WORDS[(start + i) % len(ANSWER_WORDS)] for i in range(ANSWER_LENGTH))
        messages = [{"role": "user", "content": rng.choice(USER_WORDS)}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": messages}) + "\n")
    path.write_text("".join(lines))
    return path


def build_world(root: Path, hidden: int) -> tuple[Path, Path]:
    """(target folder, drafter folder) for one size; whatever `root` already holds is reused."""
    root.mkdir(parents=True, exist_ok=True)
    chats = root / "chats.jsonl"
    if not chats.exists():
        write_chats(chats)
    tokenizer = root / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        corpus = [" ".join(USER_WORDS + ANSWER_WORDS[i:] + ANSWER_WORDS[:i]) for i in range(6)] * 20
        toy.train_tokenizer(corpus, 300, tokenizer)
    target = root / f"target-{hidden}"
    if not (target / "config.json").exists():
        untrained = toy.tiny_llama(tokenizer, root / f"untrained-{hidden}", hidden_size=hidden, num_layers=4,
                                   num_heads=4)
        toy.train_causal_lm(untrained, chats, target, steps=TARGET_STEPS, lr=1e-3 if hidden > 64 else 3e-3,
                            max_length=MAX_LENGTH)
    training_map = root / "map"
    if not (training_map / "manifest.json").exists():
        vocab_map.run(compose_stage("vocab_map", [f"tokenizer={target}", f"data={chats}", f"out={training_map}",
                                                  f"draft_vocab_size={DRAFT_VOCAB}"]))
    drafter = root / f"drafter-{hidden}"
    if not (drafter / "manifest.json").exists():
        finetune.run(compose_stage("finetune", [
            f"target={target}", f"data={chats}", f"vocab_map={training_map}", f"out={drafter}", "init=scratch",
            f"ttt_steps={TTT_STEPS}", "micro_batch_size=4", f"max_length={MAX_LENGTH}", "lr=3e-3",
            "log_every=10", "val_fraction=0.1", f"epochs={DRAFTER_EPOCHS}", "deepspeed.warmup_ratio=0.0",
            f"checkpoint_dir={root / f'checkpoints-{hidden}'}"]))
    return target, drafter_dir(drafter)


# ---------------------------------------------------------------- measurements


def decode_all(decoder: SpeculativeDecoder, target: TargetModel, prompts: list[list[int]], max_new_tokens: int,
               stops: set[int], repeat: int) -> dict[str, float]:
    """Plain and speculative decoding of every prompt, `repeat` passes (each pass runs both, interleaved)."""
    plain_seconds, spec_seconds, tokens, forwards, lossless = [], [], 0, 0, True
    for _ in range(repeat):
        plain_total, spec_total, tokens, forwards = 0.0, 0.0, 0, 0
        for prompt in prompts:
            plain = greedy_generate(target, prompt, max_new_tokens, stops)
            spec = decoder.generate(prompt, max_new_tokens, stops)
            if spec.tokens != plain.tokens:
                lossless = False
                print(f"not lossless: left plain greedy at token {first_difference(spec.tokens, plain.tokens)}")
            plain_total, spec_total = plain_total + plain.seconds, spec_total + spec.seconds
            tokens, forwards = tokens + len(spec.tokens), forwards + spec.target_forwards
        plain_seconds.append(plain_total)
        spec_seconds.append(spec_total)
    return {"tokens": tokens, "accept_len": tokens / forwards, "plain_tok_s": tokens / min(plain_seconds),
            "spec_tok_s": tokens / min(spec_seconds), "lossless": lossless}


def median_ms(calls: dict, times: int) -> dict[str, float]:
    """Median ms per call of each, the calls taken in turn so that a change of load touches them all alike."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(times):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in seconds.items()}


def forward_costs(decoder: SpeculativeDecoder, prompt: list[int], context: int, times: int) -> dict[str, float]:
    """ms per plain forward (1 token), verify forward (num_steps + 1 tokens) and draft forward (the decoder's own
    draft round fed 1 verified token, over num_steps), each after `context` tokens in the caches, each call's cache
    growth undone before the next."""
    from transformers import DynamicCache

    target, num_steps = decoder.target, decoder.num_steps
    ids = (prompt * (1 + context // len(prompt)))[:context]
    cache, drafter_cache = DynamicCache(), KVCache()
    with decoding(target.model):
        aux, _ = target_forward(target, ids, cache)
        decoder.feed_drafter(drafter_cache, aux, ids[1:] + ids[:1])

    def plain():
        target_forward(target, ids[-1:], cache)
        crop(cache, context)

    def verify():
        target_forward(target, ids[-num_steps - 1:], cache)
        crop(cache, context)

    def draft():
        decoder.draft(drafter_cache, aux[-1:], ids[-1:])
        drafter_cache.truncate(context)

    with decoding(target.model):  # the decoders' own conditions: inference mode, DECODE_THREADS
        costs = median_ms({"plain_ms": plain, "verify_ms": verify, "draft_ms": draft}, times)
    return {**costs, "draft_ms": costs["draft_ms"] / num_steps}


def measure_size(target_dir: Path, drafter_path: Path, args) -> list[dict]:
    drafter = Eagle3Drafter.from_checkpoint(drafter_path, dtype=torch.float32)
    target = TargetModel.load(target_dir, drafter.config.aux_layer_ids, drafter.config.aux_convention)
    tokenizer = load_tokenizer(target_dir)
    render = chat_renderer(tokenizer)
    stops = stop_ids(tokenizer, target_dir)
    words = [USER_WORDS[i % len(USER_WORDS)] for i in range(args.prompts)]
    prompts = [tokenizer.encode(render([{"role": "user", "content": word}]), add_special_tokens=False)
               for word in words]
    rows = []
    for num_steps in args.num_steps:
        decoder = SpeculativeDecoder(target, drafter, num_steps)
        decoder.generate(prompts[0], 8, stops)  # one-off allocations stay out of the timings
        greedy_generate(target, prompts[0], 8, stops)
        row = {"num_steps": num_steps, **decode_all(decoder, target, prompts, args.max_new_tokens, stops, args.repeat)}
        context = len(prompts[0]) + args.max_new_tokens // 2
        costs = [forward_costs(decoder, prompts[0], context, args.forward_calls) for _ in range(args.repeat)]
        row.update({key: min(cost[key] for cost in costs) for key in costs[0]})
        row["bound"] = row["accept_len"] * row["plain_ms"] / (row["verify_ms"] + num_steps * row["draft_ms"])
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-steps", type=int, nargs="+", default=[1, 3, 5], help="draft tokens per verify")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=6, help="one-turn chats, one per user word")
    parser.add_argument("--repeat", type=int, default=3, help="passes; the fastest counts")
    parser.add_argument("--forward-calls", type=int, default=50, help="calls per timed forward kind")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES.values()), help="target hidden sizes")
    parser.add_argument("--decode-threads", type=int, default=spec_decode.DECODE_THREADS,
                        help="intra-op threads while decoding (0: torch's own setting)")
    parser.add_argument("--workdir", type=Path, help="build (or reuse) the models here, and keep them")
    parser.add_argument("--keep", action="store_true", help="keep the temporary world (its path is printed)")
    args = parser.parse_args()
    spec_decode.DECODE_THREADS = args.decode_threads or None
    threads = args.decode_threads or torch.get_num_threads()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="spec_decode_bench."))
    table = Table(title=f"greedy speculative decoding, hf backend on CPU ({args.prompts} prompts, up to "
                        f"{args.max_new_tokens} new tokens, {threads} thread(s), fastest of {args.repeat})")
    for column in ("size", "num_steps", "accept_len", "plain tok/s", "spec tok/s", "speedup", "ms/plain fwd",
                   "ms/verify fwd", "ms/draft fwd", "bound", "lossless"):
        table.add_column(column, justify="right")
    loads = []  # other jobs share the CPUs: the load average as each size's measurement starts, and at the end
    try:
        for hidden in args.sizes:
            target_dir, drafter_path = build_world(root, hidden)
            name = next((name for name, size in SIZES.items() if size == hidden), f"hidden {hidden}")
            loads.append(f"{os.getloadavg()[0]:.1f} ({name})")
            for row in measure_size(target_dir, drafter_path, args):
                table.add_row(name, str(row["num_steps"]), f"{row['accept_len']:.2f}", f"{row['plain_tok_s']:,.0f}",
                              f"{row['spec_tok_s']:,.0f}", f"{row['spec_tok_s'] / row['plain_tok_s']:.2f}x",
                              f"{row['plain_ms']:.2f}", f"{row['verify_ms']:.2f}", f"{row['draft_ms']:.2f}",
                              f"{row['bound']:.2f}x", "yes" if row["lossless"] else "NO")
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif args.workdir is None:
            print(f"world kept in {root} (reuse it with --workdir {root})")
    table.caption = f"load average {', '.join(loads)}, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs"
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
