"""Benchmark: tokens/s of one finetune training step on CPU, DeepSpeed's engine against a plain PyTorch loop.

Both loops run the same drafter, data, TTT unroll (online: the target's forward inside the step), AdamW and
gradient clipping; the DeepSpeed one goes through `deepspeed.initialize` (ZeRO 0, fp32, gloo, world size 1) as the
finetune stage does. Two sizes: the toy world's (hidden 64) and a wider one (hidden 256). The goal is DeepSpeed's
overhead under 10% at world size 1. The last column is the DeepSpeed loop offline: the target's states cached by the
features stage, so a step runs only the target's lm_head instead of its whole forward.

    .venv/bin/python bench/finetune.py [--steps 30] [--warmup 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from stages.common.chat import load_tokenizer, tokenized_chats  # noqa: E402
from stages.world.corpus import as_conversation, stdlib_docstrings, write_jsonl  # noqa: E402
from stages.common.eagle3 import Eagle3Drafter  # noqa: E402
from stages.common.target import TargetModel  # noqa: E402
from stages.common.drafter_config import drafter_config_for  # noqa: E402
from stages.world.toy import tiny_llama, train_tokenizer  # noqa: E402
from stages.common.vocab import VocabMap  # noqa: E402
from stages import features  # noqa: E402
from stages.common.stage import compose_stage  # noqa: E402
from stages.common.target import TargetHead  # noqa: E402
from stages.finetune import init_distributed  # noqa: E402
from stages.finetune.loop import micro_batches, run_ttt  # noqa: E402
from stages.common.feature_shards import load_features  # noqa: E402

SIZES = {"toy (hidden 64)": 64, "wide (hidden 256)": 256}
TTT_STEPS, MICRO_BATCH, MAX_LENGTH, DRAFT_VOCAB = 5, 8, 256, 1024


def cached_rows(root: Path, target_dir: Path, data: Path) -> dict[str, torch.Tensor]:
    out = root / f"features-{target_dir.name}"
    features.run(compose_stage("features", [f"target={target_dir}", f"data={data}", f"out={out}",
                                            f"max_length={MAX_LENGTH}"]))
    config = drafter_config_for(target_dir, DRAFT_VOCAB)
    return load_features(out, config.aux_layer_ids, MAX_LENGTH)


def build_world(root: Path, hidden: int) -> tuple[TargetModel, dict[str, torch.Tensor], VocabMap, Path]:
    docs = list(stdlib_docstrings())[:600]
    data = write_jsonl([as_conversation(doc, i) for i, doc in enumerate(docs)], root / "chats.jsonl")
    tokenizer_dir = root / "tokenizer"
    if not tokenizer_dir.exists():
        train_tokenizer([doc.text for doc in docs], 4096, tokenizer_dir)
    target_dir = tiny_llama(tokenizer_dir, root / f"target-{hidden}", hidden_size=hidden, num_layers=4,
                            num_heads=4)
    rows = tokenized_chats(load_tokenizer(target_dir), data, MAX_LENGTH)
    counts = torch.bincount(rows["input_ids"][rows["loss_mask"]], minlength=4096)
    ids = torch.sort(counts, descending=True, stable=True).indices[:DRAFT_VOCAB].sort().values
    vocab_map = VocabMap.from_target_ids(ids, 4096)
    config = drafter_config_for(target_dir, DRAFT_VOCAB)
    return TargetModel.load(target_dir, config.aux_layer_ids), rows, vocab_map, target_dir


def fresh_drafter(target_dir: Path, vocab_map: VocabMap) -> Eagle3Drafter:
    return Eagle3Drafter.initialised(drafter_config_for(target_dir, DRAFT_VOCAB), vocab_map, seed=0)


def time_loop(step, batches, warmup: int) -> tuple[float, int]:
    seconds, tokens = 0.0, 0
    for index, batch in enumerate(batches):
        start = time.perf_counter()
        step(batch)
        if index >= warmup:
            seconds += time.perf_counter() - start
            tokens += int(batch["attention_mask"].sum())
    return seconds, tokens


def plain_loop(drafter: Eagle3Drafter, target: TargetModel):
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95))

    def step(batch):
        loss = run_ttt(drafter, target, batch, TTT_STEPS).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        optimizer.step()

    return step


def deepspeed_loop(drafter: Eagle3Drafter, target: TargetModel):
    import deepspeed

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(model=drafter, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9})

    def step(batch):
        loss = run_ttt(engine.module, target, batch, TTT_STEPS).loss
        engine.backward(loss)
        engine.step()

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    init_distributed(launched=False, seed=0)
    table = Table(title=f"finetune step throughput (CPU, batch {MICRO_BATCH} x {MAX_LENGTH}, TTT {TTT_STEPS}, online)")
    for column in ("size", "drafter params", "plain tok/s", "DeepSpeed tok/s", "DeepSpeed overhead",
                   "offline DeepSpeed tok/s"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for name, hidden in SIZES.items():
            target, rows, vocab_map, target_dir = build_world(Path(tmp), hidden)
            results = {}
            for label, make in (("plain", plain_loop), ("deepspeed", deepspeed_loop), ("plain again", plain_loop)):
                torch.manual_seed(0)
                drafter = fresh_drafter(target_dir, vocab_map)
                batches = list(micro_batches(rows, MICRO_BATCH, 0, 0, 0, 1))[: args.steps + args.warmup]
                seconds, tokens = time_loop(make(drafter, target), batches, args.warmup)
                results[label] = tokens / seconds
            torch.manual_seed(0)
            offline_rows = cached_rows(Path(tmp), target_dir, Path(tmp) / "chats.jsonl")
            batches = list(micro_batches(offline_rows, MICRO_BATCH, 0, 0, 0, 1))[: args.steps + args.warmup]
            seconds, tokens = time_loop(deepspeed_loop(fresh_drafter(target_dir, vocab_map), TargetHead(target_dir)),
                                        batches, args.warmup)
            results["offline"] = tokens / seconds
            plain = (results["plain"] + results["plain again"]) / 2  # before and after, to average out drift
            params = sum(p.numel() for p in fresh_drafter(target_dir, vocab_map).parameters())
            table.add_row(name, f"{params / 1e6:.2f} M", f"{plain:,.0f}", f"{results['deepspeed']:,.0f}",
                          f"{plain / results['deepspeed'] - 1:+.1%}", f"{results['offline']:,.0f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
