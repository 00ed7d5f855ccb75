"""Benchmark: tokens/s of one finetune training step on CPU, DeepSpeed's engine against a plain PyTorch loop.

Both loops run the same drafter, data, TTT unroll (online: the target's forward inside the step), AdamW and
gradient clipping; the DeepSpeed one goes through `deepspeed.initialize` (ZeRO 0, fp32, gloo, world size 1) as the
finetune stage does. Two sizes: the toy world's (hidden 64) and a wider one (hidden 256). The goal is DeepSpeed's
overhead under 10% at world size 1. The last column is the DeepSpeed loop offline: the target's states cached by the
features stage, so a step runs only the target's lm_head instead of its whole forward.

The other table (printed first) is one TTT step (forward + backward, 1 intra-op thread) of regraft's `ttt_forward` on the target's
signals (full-vocab argmax and draft-vocab logits computed once per batch, the lm_head in vocab chunks) against a plain
re-statement of the reference computation (SpecForge 0.2.0's loop: full-vocab target logits, then argmax, draft-vocab
gather and softmax redone at every step on shifted copies), on the same weights and batch with the same loss mask
(`specforge`, so the numbers agree): time per step and the peak RSS of a fresh process per variant. The goal is
regraft's step no slower and its peak memory no higher.

    .venv/bin/python bench/finetune.py [--steps 30] [--warmup 5] [--only throughput|ttt] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
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

from stages.common.data.chat import load_tokenizer, tokenized_chats  # noqa: E402
from stages.world.corpus import as_conversation, stdlib_docstrings, write_jsonl  # noqa: E402
from stages.common.drafter.eagle3 import Eagle3Drafter  # noqa: E402
from stages.common.drafter.target import TargetModel  # noqa: E402
from stages.common.drafter.config import drafter_config_for  # noqa: E402
from stages.world.toy import tiny_llama, train_tokenizer  # noqa: E402
from stages.common.drafter.vocab import VocabMap  # noqa: E402
from stages import features  # noqa: E402
from stages.common.contract.stage import compose_stage  # noqa: E402
from stages.common.drafter.target import TargetHead  # noqa: E402
from stages.finetune import init_distributed  # noqa: E402
from stages.finetune.loop import micro_batches, run_ttt  # noqa: E402
from stages.common.data.feature_shards import load_features  # noqa: E402
from stages.common.drafter.config import DrafterConfig  # noqa: E402
from stages.common.drafter.eagle3 import TTTCache  # noqa: E402
from stages.common.drafter.target import TargetSignals  # noqa: E402
from stages.common.drafter.ttt import LossMask, draft_vocab_ids, ttt_forward  # noqa: E402

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


# ---------------------------------------------------------------- one TTT step: regraft against the reference

TTT_VOCAB, TTT_DRAFT_VOCAB, TTT_HIDDEN, TTT_LENGTHS, TTT_REPEATS, TTT_ROUNDS = 32000, 6400, 512, (512, 1024), 3, 2
# The draft ids' rows of the target's lm_head scaled up, so that its argmax falls in the draft vocab at about 95% of
# positions, as a top-N draft vocab covers a real target's tokens (with plain random rows it would be N / V = 20%,
# and a step that skips the positions without a loss would look faster than it is on real data).
DRAFT_ROW_SCALE = 1.3


def ttt_world(length: int) -> dict:
    """The same weights and batch in every process (seeded): a drafter (hidden 512, draft vocab 6,400 of 32,000 ids:
    Kimi-K2.5's ratio, 32,000 of 163,840), the target's embeddings and lm_head, one row's cached aux and final
    hidden states, and a two-turn assistant mask (user 0-10%, assistant to 55%, user to 60%, assistant to T-2)."""
    V, N, H = TTT_VOCAB, TTT_DRAFT_VOCAB, TTT_HIDDEN
    layer = {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu", "hidden_size": H,
             "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1408, "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, "max_position_embeddings": 4096, "vocab_size": V}
    generator = torch.Generator().manual_seed(0)
    ids = torch.randperm(V, generator=generator)[:N].sort().values
    config = DrafterConfig(layer=layer, draft_vocab_size=N, aux_layer_ids=[1, 15, 28], target_num_layers=32)
    drafter = Eagle3Drafter.initialised(config, VocabMap.from_target_ids(ids, V), seed=0)
    embedding = torch.nn.Embedding.from_pretrained(torch.randn(V, H, generator=generator) * 0.02, freeze=True)
    loss_mask = torch.zeros(1, length, dtype=torch.bool)
    loss_mask[:, length // 10:length * 55 // 100] = True
    loss_mask[:, length * 60 // 100:length - 1] = True
    lm_head = torch.randn(V, H, generator=generator) * 0.2
    lm_head[ids] *= DRAFT_ROW_SCALE
    return {"drafter": drafter, "embed": embedding, "lm_head": lm_head,
            "input_ids": torch.randint(0, V, (1, length), generator=generator), "loss_mask": loss_mask,
            "aux": torch.randn(1, length, 3 * H, generator=generator),
            "last_hidden": torch.randn(1, length, H, generator=generator)}


def regraft_ttt_step(world: dict, steps: int) -> torch.Tensor:
    """regraft: the target's signals once (chunked lm_head), then ttt_forward, then backward."""
    drafter = world["drafter"]
    signals = TargetSignals.from_hidden(world["last_hidden"], world["lm_head"], draft_vocab_ids(drafter))
    stats = ttt_forward(drafter, world["embed"], world["input_ids"], world["loss_mask"], world["aux"], signals, steps,
                        LossMask.specforge)
    stats.loss.backward()
    return stats.step_losses


def reference_ttt_step(world: dict, steps: int) -> torch.Tensor:
    """The reference (SpecForge 0.2.0's OnlineEagle3Model loop, restated on the same drafter module): the target's
    full logits, padded one left; every step takes the argmax over the full vocab, gathers the draft columns and
    softmaxes them, and shifts input ids, logits and mask one further left (copies)."""
    drafter = world["drafter"]

    def padding(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[:, 1:], torch.zeros_like(x[:, -1:])), dim=1)

    with torch.no_grad():
        target = padding(world["last_hidden"] @ world["lm_head"].T)  # [1, T, V]
    input_ids, loss_mask = padding(world["input_ids"]), world["loss_mask"][..., None].int()
    hidden, cache = drafter.project_aux(world["aux"]), TTTCache()
    positions = torch.arange(input_ids.shape[1])[None]
    total, losses = torch.zeros(()), []
    for idx in range(steps):
        out = drafter(world["embed"](input_ids), hidden, positions + idx, cache=cache)
        with torch.no_grad():
            position_mask = drafter.t2d[target.argmax(-1)][..., None].int() * loss_mask
            target_p = torch.softmax(target[..., drafter.t2d].float(), dim=2)
        hidden = out.hidden
        loss = -torch.sum(position_mask * (target_p * torch.log_softmax(out.logits.float(), dim=2)), 2).mean()
        losses.append(loss.detach())
        total = total + 0.8 ** idx * loss
        if idx < steps - 1:
            input_ids, target, loss_mask = padding(input_ids), padding(target), padding(loss_mask)
    total.backward()
    return torch.stack(losses)


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def ttt_variant(variant: str, length: int, repeats: int, steps: int) -> dict:
    """One variant in this (fresh) process, 1 intra-op thread: CPU and wall seconds per step (the CPU time is the
    fairer clock on a shared machine), RSS before and at peak."""
    torch.set_num_threads(1)
    world = ttt_world(length)
    step = {"regraft": regraft_ttt_step, "reference": reference_ttt_step}[variant]
    setup = rss_mb()
    seconds, cpu, losses = [], [], None
    for _ in range(repeats + 1):  # the first is warmup
        world["drafter"].zero_grad(set_to_none=True)
        start, start_cpu = time.perf_counter(), time.process_time()
        losses = step(world, steps)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    grads = [p.grad for p in world["drafter"].parameters() if p.grad is not None]
    signals = TargetSignals.from_hidden(world["last_hidden"], world["lm_head"], draft_vocab_ids(world["drafter"]))
    with_loss = world["loss_mask"] & world["drafter"].t2d[signals.argmax]
    return {"variant": variant, "with_loss": float(with_loss.float().mean()), "length": length,
            "seconds": min(seconds[1:]), "cpu": min(cpu[1:]), "setup_mb": setup,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "losses": losses.tolist(),
            "grad_norm": float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))}


def ttt_results(repeats: int) -> dict[int, dict[str, dict]]:
    """Per length, each variant's best CPU and wall seconds over TTT_ROUNDS fresh processes run alternately (so a
    busy machine slows both alike), its peak RSS, losses and gradient norm."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    by_length: dict[int, dict[str, dict]] = {}
    for length in TTT_LENGTHS:
        results = by_length.setdefault(length, {})
        for _ in range(TTT_ROUNDS):
            for variant in ("reference", "regraft"):
                done = subprocess.run([sys.executable, __file__, "--ttt-variant", variant, "--length", str(length),
                                       "--repeats", str(repeats)], env=env, capture_output=True, text=True,
                                      check=True, timeout=1800)
                run = json.loads(done.stdout.strip().splitlines()[-1])
                kept = results.setdefault(variant, run)
                kept["seconds"], kept["cpu"] = min(kept["seconds"], run["seconds"]), min(kept["cpu"], run["cpu"])
                kept["peak_mb"], kept["setup_mb"] = max(kept["peak_mb"], run["peak_mb"]), run["setup_mb"]
    return by_length


TTT_COLUMNS = ("T", "variant", "CPU s / step", "wall s / step", "CPU time vs reference", "peak RSS",
               "peak RSS vs reference", "peak over setup", "largest loss_k gap to reference", "grad norm")


def ttt_rows(by_length: dict[int, dict[str, dict]]) -> list[tuple[str, ...]]:
    rows = []
    for length, results in by_length.items():
        reference = results["reference"]
        for variant in ("reference", "regraft"):
            r = results[variant]
            gap = max(abs(a - b) for a, b in zip(r["losses"], reference["losses"]))
            rows.append((f"{length:,}", variant, f"{r['cpu']:.2f}", f"{r['seconds']:.2f}",
                         f"{r['cpu'] / reference['cpu']:.2f}x", f"{r['peak_mb']:,.0f} MB",
                         f"{r['peak_mb'] / reference['peak_mb']:.2f}x", f"{r['peak_mb'] - r['setup_mb']:,.0f} MB",
                         f"{gap:.1e}", f"{r['grad_norm']:.5f}"))
    return rows


def ttt_title(by_length: dict[int, dict[str, dict]], repeats: int) -> str:
    share = next(iter(by_length.values()))["regraft"]["with_loss"]
    return (f"one TTT step, forward + backward (CPU, 1 thread, batch 1, TTT {TTT_STEPS}, vocab {TTT_VOCAB:,}, draft "
            f"vocab {TTT_DRAFT_VOCAB:,}, hidden {TTT_HIDDEN}, loss mask `specforge`, about {share:.0%} of positions "
            f"with a loss; the best of {repeats} steps in each of {TTT_ROUNDS} fresh processes per variant, run "
            "alternately)")


def ttt_table(by_length: dict[int, dict[str, dict]], repeats: int) -> Table:
    table = Table(title=ttt_title(by_length, repeats))
    for column in TTT_COLUMNS:
        table.add_column(column, justify="right")
    for row in ttt_rows(by_length):
        table.add_row(*row)
    return table


def ttt_block(by_length: dict[int, dict[str, dict]], repeats: int) -> str:
    from bench.figures import code_commit, cpu_model

    lines = ["| " + " | ".join(TTT_COLUMNS) + " |", "|" + "---|" * len(TTT_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in ttt_rows(by_length)]
    return "\n".join([ttt_title(by_length, repeats)[0].upper() + ttt_title(by_length, repeats)[1:] + ":", "",
                      *lines, "", f"`bench/finetune.py --only ttt --write`, written by the script on "
                      f"{time.strftime('%Y-%m-%d')} at commit {code_commit()}, on {cpu_model()}.", ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", choices=("throughput", "ttt"), help="run one of the two tables")
    parser.add_argument("--repeats", type=int, default=TTT_REPEATS, help="timed TTT steps per variant")
    parser.add_argument("--write", action="store_true", help="write the TTT table into docs/results.md (ttt-step)")
    parser.add_argument("--ttt-variant", choices=("regraft", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=TTT_LENGTHS[0], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ttt_variant:  # a child process of ttt_table
        print(json.dumps(ttt_variant(args.ttt_variant, args.length, args.repeats, TTT_STEPS)))
        return 0
    if args.only != "throughput":
        by_length = ttt_results(args.repeats)
        Console(width=150).print(ttt_table(by_length, args.repeats))
        if args.write:
            from bench.figures import write_blocks

            write_blocks({"ttt-step": ttt_block(by_length, args.repeats)})
    if args.only == "ttt":
        return 0
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
