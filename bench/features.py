"""Benchmark: what the target's states cost a fine-tune, cached padded, cached ragged, or online from vLLM.

Each case runs `regraft` on the default world (phase 1's fine-tune only: no probe, evaluate, baseline or diagnose)
in one outputs folder, so the world, the map and the remap are built once and cached:

  padded   features.layout=padded: the features stage caches every row at max_length, the fine-tune streams them
  ragged   the default: the features stage caches each conversation's tokens only
  online   features.mode=online: no features stage; the fine-tune asks a `vllm serve` (engine venv) per batch

Per case: the disk high-water mark of the states (offline: the shards; online: the server's state files, sampled
every 20 ms while the fine-tune runs), the fine-tune's training tokens/s (its last logged `tokens_per_s`), and the
engine's share of the wall time (offline: the features stage's seconds over it plus the fine-tune's; online: the
server's seconds computing states over the fine-tune's, and the share the trainer waited for them). Then the same
arithmetic at Kimi-K2.5's scale (stated inputs, nothing measured) for 100K samples of 2,000 tokens.

    .venv/bin/python bench/features.py                       # ~10 minutes on 2 cores (needs make venv-vllm)
    .venv/bin/python bench/features.py --write features-cost # also into docs/results.md's block
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the stages, for the drafters the runs export
PHASE1_ONLY = ["pipeline.probe=false", "pipeline.evaluate=false", "pipeline.baseline=false",
               "pipeline.diagnose=false", "tracking.enabled=false"]
CASES = {"padded": ["features.layout=padded"], "ragged": [], "online": ["features.mode=online"]}

# Kimi-K2.5 at the seeds' scale: inputs of the arithmetic, each as its source states it
KIMI = {"hidden": 7168, "bytes_per_value": 2, "aux_layers": 3, "samples": 100_000, "tokens_per_sample": 2_000,
        "max_length": 2_048,  # conf/experiment/kimi_k25.yaml finetune.max_length
        "epochs": 2,  # conf/experiment/kimi_k25.yaml finetune.epochs
        "active_params": 32e9,  # Kimi-K2's model card: 32B activated of 1T (K2.5 keeps the architecture)
        "gpu_flops": 989e12,  # one H200's dense bf16 peak (NVIDIA's datasheet)
        "mfu": 0.4,  # assumed prefill utilisation; prefill of long prompts is compute-bound
        "prefetch_batches": 2, "micro_batch": 1, "ranks": 8}  # finetune.engine.prefetch, the experiment's batch


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.exists() else 0


class HighWater:
    """The largest total size of the folders named `name` under `root`, sampled until stopped."""

    def __init__(self, root: Path, name: str):
        self.root, self.name, self.peak = root, name, 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.stopping.wait(0.02):
            try:
                self.peak = max(self.peak, sum(folder_bytes(f) for f in self.root.rglob(self.name) if f.is_dir()))
            except OSError:  # a file went while it was measured
                continue

    def stop(self) -> int:
        self.stopping.set()
        self.thread.join()
        return self.peak


def regraft(outputs: Path, overrides: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", *PHASE1_ONLY,
                           *overrides], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"regraft {' '.join(overrides)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    run = sorted((outputs / "runs").iterdir(), key=lambda path: path.stat().st_mtime)[-1]
    return json.loads((run / "summary.json").read_text())


def last_logged(out: Path, key: str) -> float:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line[key] for line in lines if key in line][-1]


def measure(outputs: Path, case: str) -> dict:
    watch = HighWater(outputs, "engine_states")
    summary = regraft(outputs, CASES[case])
    engine_peak = watch.stop()
    stages = summary["stages"]
    tune = stages["finetune"]
    finetune_manifest = json.loads((Path(tune["out"]) / "manifest.json").read_text())
    row = {"case": case, "finetune_s": tune["seconds"], "ran": not tune["hit"], "out": tune["out"],
           "loss_0": finetune_manifest["metrics"]["preflight_loss_0"],
           "tokens_per_s": last_logged(Path(tune["out"]), "tokens_per_s")}
    if case == "online":
        metrics = finetune_manifest["metrics"]
        row.update(disk=engine_peak, engine_share=metrics["engine_seconds"] / tune["seconds"],
                   wait_share=metrics["engine_wait_seconds"] / tune["seconds"])
    else:
        shards = json.loads((Path(stages["features"]["out"]) / "manifest.json").read_text())["metrics"]
        features_s = stages["features"]["seconds"]
        row.update(disk=shards["bytes"], tokens=shards["tokens"], bytes_vs_tokens=shards["bytes_vs_tokens"],
                   engine_share=features_s / (features_s + tune["seconds"]), wait_share=None)
    return row


def kimi_arithmetic(inputs: dict) -> list[tuple[str, str, str]]:
    """(mode, disk, target GPU-hours) at Kimi-K2.5's scale, each figure with the arithmetic that gives it."""
    per_token = (inputs["aux_layers"] + 1) * inputs["hidden"] * inputs["bytes_per_value"]
    # a ragged row stores one position after its tokens, and every position its int64 id and bool loss mask
    ragged_overhead = (1 + 1 / inputs["tokens_per_sample"]) * (1 + 9 / per_token)
    tokens = inputs["samples"] * inputs["tokens_per_sample"]
    flops_per_token = 2 * inputs["active_params"]  # a forward: 2 FLOPs per active parameter per token
    gpu_hours = tokens * flops_per_token / (inputs["gpu_flops"] * inputs["mfu"]) / 3600
    window = inputs["prefetch_batches"] * inputs["micro_batch"] * inputs["ranks"] * inputs["tokens_per_sample"]
    tb = 1e12
    return [
        ("offline, padded", f"{inputs['samples']:,} x {inputs['max_length']:,} x {per_token:,} B = "
         f"{inputs['samples'] * inputs['max_length'] * per_token / tb:.2f} TB",
         f"{gpu_hours:,.1f} (one forward over the data)"),
        ("offline, ragged", f"{tokens:,} x {per_token:,} B x {ragged_overhead:.4f} = "
         f"{tokens * per_token * ragged_overhead / tb:.2f} TB", f"{gpu_hours:,.1f} (one forward over the data)"),
        ("online", f"{inputs['prefetch_batches']} x {inputs['micro_batch']} x {inputs['ranks']} ranks x "
         f"{inputs['tokens_per_sample']:,} x {per_token:,} B = {window * per_token / 1e9:.2f} GB",
         f"{inputs['epochs']} x {gpu_hours:,.1f} = {inputs['epochs'] * gpu_hours:,.1f} (a forward every epoch)")]


def agreement(rows: list[dict]) -> str:
    """How far the online fine-tune is from the offline (ragged) one: step-0 loss and the exported weights."""
    by_case = {row["case"]: row for row in rows}
    if not {"ragged", "online"} <= set(by_case):
        return ""
    from stages.common.drafter.eagle3 import Eagle3Drafter

    offline, online = (Eagle3Drafter.from_checkpoint(Path(by_case[case]["out"]) / "drafter").state_dict()
                       for case in ("ragged", "online"))
    worst = max(float((online[name] - tensor).abs().max() / tensor.abs().max().clamp(min=1e-12))
                for name, tensor in offline.items() if tensor.is_floating_point())
    a, b = by_case["ragged"]["loss_0"], by_case["online"]["loss_0"]
    return (f"Online against offline (ragged), the same fine-tune: step-0 loss {b:.6f} against {a:.6f} "
            f"({abs(b - a) / a:.1e} relative); exported weights at most {worst:.1e} of each tensor's largest value "
            "apart.\n")


def report(rows: list[dict], kimi: list[tuple[str, str, str]]) -> str:
    lines = ["| case | states on disk (high-water) | bytes / (tokens x bytes per token) | fine-tune tokens/s | "
             "engine's share of wall time | trainer waited |", "|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row['bytes_vs_tokens']:.3f}" if "bytes_vs_tokens" in row else "-"
        waited = f"{row['wait_share']:.0%}" if row["wait_share"] is not None else "-"
        lines.append(f"| {row['case']} | {row['disk'] / 2 ** 20:.1f} MiB | {ratio} | {row['tokens_per_s']:,.0f} | "
                     f"{row['engine_share']:.0%} | {waited} |")
    lines += ["", agreement(rows), f"At Kimi-K2.5's scale: {KIMI['samples']:,} samples x {KIMI['tokens_per_sample']:,} tokens, "
              f"H = {KIMI['hidden']}, bf16, {KIMI['aux_layers']} aux states and the final one; the target's forward at "
              f"2 x {KIMI['active_params'] / 1e9:.0f}B active parameters per token on H200s at {KIMI['mfu']:.0%} of "
              f"{KIMI['gpu_flops'] / 1e12:.0f} TFLOP/s (assumed utilisation), {KIMI['epochs']} epochs, prefetch "
              f"{KIMI['prefetch_batches']} micro-batches of {KIMI['micro_batch']} on {KIMI['ranks']} ranks; a ragged row "
              "stores one position after its tokens, and every position its token id and loss mask (9 bytes).", "",
              "| mode | features on disk | target GPU-hours |", "|---|---|---|"]
    lines += [f"| {mode} | {disk} | {hours} |" for mode, disk, hours in kimi]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES))
    parser.add_argument("--outputs", type=Path, default=None, help="outputs folder (default: a fresh temp one)")
    parser.add_argument("--write", metavar="NAME", help="also write the report into the figure block NAME (docs/)")
    args = parser.parse_args()
    outputs = args.outputs or Path(tempfile.mkdtemp(prefix="bench-features-"))
    rows = []
    for case in args.cases:
        started = time.perf_counter()
        rows.append(measure(outputs, case))
        print(f"{case}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    table = Table(title="the target's states for one fine-tune, default world")
    for column in ("case", "disk MiB", "bytes/tokens", "tokens/s", "engine share", "waited"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["case"], f"{row['disk'] / 2 ** 20:.1f}", f"{row.get('bytes_vs_tokens', float('nan')):.3f}",
                      f"{row['tokens_per_s']:,.0f}", f"{row['engine_share']:.0%}",
                      "-" if row["wait_share"] is None else f"{row['wait_share']:.0%}")
    Console().print(table)
    text = report(rows, kimi_arithmetic(KIMI))
    print(text)
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        from figures import write_blocks, written  # bench/figures.py, beside this file

        command = f"bench/features.py --cases {' '.join(args.cases)} --write {args.write}"
        write_blocks({args.write: text + "\n" + written(command) + "\n"})


if __name__ == "__main__":
    main()
