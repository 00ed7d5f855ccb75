"""Benchmark: the target on vLLM (the CPU build in `.venv-vllm`) against the hf path, for the two stages that run it.

Both rows of a pair run the pipeline's own stage on the same target, drafter and data, in this process:

  features   `stages.features backend=hf|vllm` over the training chats (data_b.jsonl): the target's aux and final
             hidden states, written as shards. tok/s counts real tokens (padding left out) from the end of the
             second batch to the end of the last, so the model load, the first request and the engine's stop stay
             out of it.
  probe      `stages.probe backend=hf|vllm` on the held-out prompts (prompts_b.jsonl): greedy decoding with the
             drafter (spec tok/s) and without (plain tok/s), every answer checked lossless by the stage; its own
             figures (tok/s over the decoding after a warm-up request, accept_len: emitted / target forwards; for
             vllm also vLLM's 1 + accepted / drafts).

Start-up cost, apart from the steady state: `import s` is, for hf, a fresh `.venv` interpreter's import of the stage
module, torch, transformers and the target's model class (which transformers imports lazily at the first load): what
`python -m stages.NAME` pays before it reads a weight; for vllm, the engine process's import of vLLM
(`VllmEngine.import_seconds`). `startup s` is, for hf, loading the target (and, for the probe, the drafter) from disk;
for vllm, the engine's start (`VllmEngine.startup_seconds`: model load, KV cache), with the probe's plain engine,
started in the same worker, in brackets. `wall s` is the whole stage call (the vllm probe's includes its plain pass
and the hf lossless check). Every row runs on `--threads` intra-op threads (the hf probe's own default and the vLLM
engine's `vllm.threads`; hf features would otherwise take torch's default).

The world and drafter: `--world DIR` (a built world: target_b, data_b.jsonl, prompts_b.jsonl) and `--drafter DIR`
(a drafter for target_b, either layout, or a finetune output). Without them the built-in world is built with the
world stage (2-3 minutes on 2 idle cores) and a drafter trained from scratch on target_b with the vocab_map and
finetune stages (under 2 minutes); `--workdir` keeps them for the next run. The measurement itself takes about 4
minutes on 2 cores (`--quick`: about 2). vLLM's CPU attention needs head_dim >= 32 (the default world: 128 / 4).

    .venv/bin/python bench/engines.py [--world DIR] [--drafter DIR] [--workdir DIR] [--quick] [--rows 512]
                                      [--prompts 16] [--max-new-tokens 64] [--num-steps 3] [--threads 1] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from stages.common.contract.runtime import set_process_defaults  # noqa: E402

set_process_defaults()

import transformers  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from stages import features, finetune, probe, vocab_map  # noqa: E402
from stages import world as world_stage  # noqa: E402
from stages.common.drafter import spec_decode  # noqa: E402
from stages.common.contract.runtime import torch_threads  # noqa: E402
from stages.common.contract.stage import compose_stage  # noqa: E402
from stages.common.engines.vllm_engine import engine_available  # noqa: E402

DRAFT_VOCAB, DRAFTER_STEPS = 1024, 60  # the built-in source drafter's (pipelines/schema.py SourceBuild)


# ---------------------------------------------------------------- the world and drafter


def build_world(root: Path) -> Path:
    out = root / "world"
    if not (out / "manifest.json").exists():
        world_stage.run(compose_stage("world", [f"out={out}"]))
    return out


def build_drafter(root: Path, world: Path) -> Path:
    """A drafter for target_b, as the pipeline builds its source drafter: a draft vocab counted on data_b, then a
    from-scratch fine-tune (SourceBuild's settings)."""
    counted, trained = root / "vocab_map", root / "drafter"
    if not (counted / "manifest.json").exists():
        vocab_map.run(compose_stage("vocab_map", [f"tokenizer={world / 'target_b'}", f"data={world / 'data_b.jsonl'}",
                                                  f"out={counted}", f"draft_vocab_size={DRAFT_VOCAB}"]))
    if not (trained / "manifest.json").exists():
        finetune.run(compose_stage("finetune", [
            f"target={world / 'target_b'}", f"data={world / 'data_b.jsonl'}", f"vocab_map={counted}",
            f"out={trained}", "init=scratch", "ttt_steps=3", "lr=3e-3", f"max_steps={DRAFTER_STEPS}",
            f"epochs={DRAFTER_STEPS}", "micro_batch_size=8", "max_length=96", "val_fraction=0.02",
            f"checkpoint_every={DRAFTER_STEPS}"]))
    return trained


def first_lines(source: Path, count: int, out: Path) -> Path:
    with source.open() as lines:
        out.write_text("".join(line for _, line in zip(range(count), lines)))
    return out


# ---------------------------------------------------------------- start-up the stages cannot see


def architecture(target: Path) -> str:
    return json.loads((target / "config.json").read_text())["architectures"][0]


def hf_import_seconds(module: str, target: Path) -> float:
    """Seconds a fresh `.venv` interpreter takes to import a stage module, torch and transformers with it, and the
    target's model class (transformers imports it lazily, at the first load)."""
    code = (f"import time; start = time.perf_counter(); import {module}; import transformers; "
            f"transformers.{architecture(target)}; print(time.perf_counter() - start)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- measurements


def measure_features(backend: str, world: Path, drafter: Path, data: Path, out: Path, threads: int) -> dict:
    cfg = compose_stage("features", [f"target={world / 'target_b'}", f"data={data}", f"drafter={drafter}",
                                     f"out={out}", f"backend={backend}", f"vllm.threads={threads}"])
    start = time.perf_counter()
    with torch_threads(threads):
        metrics = features.run(cfg).metrics
    wall = time.perf_counter() - start
    if "extract_tok_s" not in metrics:
        raise SystemExit(f"features {backend}: fewer than 3 batches; give --rows at least 3 x the batch size")
    row = {"stage": "features", "backend": backend, "tokens": metrics["tokens"], "rows": metrics["rows"],
           "tok_s": metrics["extract_tok_s"], "wall_seconds": wall}
    if backend == "vllm":
        row.update(import_seconds=metrics["import_seconds"], startup_seconds=metrics["startup_seconds"])
    else:
        row.update(import_seconds=hf_import_seconds("stages.features", world / "target_b"),
                   startup_seconds=metrics["load_seconds"])
    return row


def measure_probe(backend: str, world: Path, drafter: Path, args, out: Path) -> dict:
    cfg = compose_stage("probe", [f"target={world / 'target_b'}", f"drafter={drafter}", f"out={out}",
                                  f"backend={backend}", f"eval_sets=[{{name: b, path: '{world / 'prompts_b.jsonl'}'}}]",
                                  f"num_prompts={args.prompts}", f"max_new_tokens={args.max_new_tokens}",
                                  f"num_steps={args.num_steps}", f"vllm.threads={args.threads}"])
    start = time.perf_counter()
    metrics = probe.run(cfg).metrics
    wall = time.perf_counter() - start
    row = {"stage": "probe", "backend": backend, "tokens": metrics["completion_tokens"], "turns": metrics["turns"],
           "tok_s": metrics["tok_s"], "plain_tok_s": metrics["plain_tok_s"], "speedup": metrics["speedup"],
           "accept_len": metrics["accept_len"], "wall_seconds": wall}
    if backend == "vllm":
        row.update(accept_len_vllm=metrics["accept_len_vllm"], import_seconds=metrics["import_seconds"],
                   startup_seconds=metrics["startup_seconds"], plain_startup_seconds=metrics["plain_startup_seconds"])
    else:  # loading the target and the drafter, as the stage measured it
        row.update(import_seconds=hf_import_seconds("stages.probe", world / "target_b"),
                   startup_seconds=metrics["load_seconds"])
    return row


# ---------------------------------------------------------------- the table


def cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


def results_table(rows: list[dict], title: str, caption: str) -> Table:
    table = Table(title=title, caption=caption)
    for column in ("stage", "backend", "tokens", "tok/s (steady)", "import s", "startup s", "wall s", "plain tok/s",
                   "speedup", "accept_len", "accept_len (vLLM's)"):
        table.add_column(column, justify="left" if column in ("stage", "backend") else "right")
    for row in rows:
        startup = cell(row, "startup_seconds", ".2f")
        if row.get("plain_startup_seconds") is not None:
            startup += f" (+{row['plain_startup_seconds']:.2f})"
        label = "tok/s" if row["stage"] == "features" else "spec tok/s"
        table.add_row(row["stage"], row["backend"], f"{row['tokens']:,}", f"{row['tok_s']:,.0f} {label}",
                      cell(row, "import_seconds", ".2f"), startup, cell(row, "wall_seconds", ".1f"),
                      cell(row, "plain_tok_s", ",.0f"),
                      "-" if row.get("speedup") is None else f"{row['speedup']:.2f}x",
                      cell(row, "accept_len", ".3f"), cell(row, "accept_len_vllm", ".3f"))
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=Path, help="a built world (target_b, data_b.jsonl, prompts_b.jsonl)")
    parser.add_argument("--drafter", type=Path, help="a drafter for target_b (default: train one here)")
    parser.add_argument("--workdir", type=Path, help="build (or reuse) the world and drafter here, and keep them")
    parser.add_argument("--quick", action="store_true", help="64 rows, 4 prompts, 32 new tokens")
    parser.add_argument("--rows", type=int, help="training chats for features (default 512: all of data_b)")
    parser.add_argument("--prompts", type=int, help="probe conversations (default 16: all of prompts_b)")
    parser.add_argument("--max-new-tokens", type=int, help="per probe answer (default 64)")
    parser.add_argument("--num-steps", type=int, default=3, help="draft tokens per verify")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for every row")
    parser.add_argument("--only", choices=("features", "probe"), help="one of the two stages")
    parser.add_argument("--out", type=Path, help="also write the rows (and the machine) as JSON here")
    args = parser.parse_args()
    args.rows = args.rows or (64 if args.quick else 512)
    args.prompts = args.prompts or (4 if args.quick else 16)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 64)
    if not engine_available():
        raise SystemExit("no vLLM engine venv (.venv-vllm): run `make venv-vllm`")
    spec_decode.DECODE_THREADS = args.threads
    root = args.workdir or Path(tempfile.mkdtemp(prefix="engines_bench."))
    scratch = Path(tempfile.mkdtemp(prefix="engines_bench_out."))
    rows, loads = [], []
    try:
        world = args.world or build_world(root)
        drafter = probe.drafter_dir(args.drafter or build_drafter(root, world))  # a finetune output: its drafter/
        data = first_lines(world / "data_b.jsonl", args.rows, scratch / "data.jsonl")
        getattr(transformers, architecture(world / "target_b"))  # its import counts in `import s`, not `startup s`
        for backend in ("hf", "vllm"):
            if args.only != "probe":
                loads.append(f"{os.getloadavg()[0]:.1f} (features {backend})")
                rows.append(measure_features(backend, world, drafter, data, scratch / f"features-{backend}",
                                             args.threads))
        for backend in ("hf", "vllm"):
            if args.only != "features":
                loads.append(f"{os.getloadavg()[0]:.1f} (probe {backend})")
                rows.append(measure_probe(backend, world, drafter, args, scratch / f"probe-{backend}"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    loads.append(f"{os.getloadavg()[0]:.1f} at the end")
    machine = {"cpus": os.cpu_count(), "load_average": loads, "threads": args.threads}
    title = (f"target_b on vLLM (CPU build) vs hf: features over {args.rows} chats, probe on {args.prompts} "
             f"conversations (up to {args.max_new_tokens} new tokens, {args.num_steps} draft steps)")
    caption = f"{os.cpu_count()} CPUs, {args.threads} intra-op thread(s); load average {', '.join(loads)}"
    Console(width=None if sys.stdout.isatty() else 170).print(results_table(rows, title, caption))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine, "settings": {
            "world": str(args.world or "built"), "drafter": str(args.drafter or "trained"), "rows": args.rows,
            "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "num_steps": args.num_steps},
            "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
