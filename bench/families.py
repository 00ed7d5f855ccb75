"""Benchmark: every drafter family through the default pipeline, and the cost of its TTT step.

1. The default run once per family (`regraft source.build.family=F`: the built-in source drafter, its remap, the
   re-alignment, both fine-tunes and the three measurements all of that family; the world is shared and cached):
   phase 0, phase 1 and scratch accept_len, and the step-0 loss of the source as it is, remapped (the guard's, on
   the first training batch) and re-aligned (diagnose's, on held-out rows, beside diagnose's remapped one).
2. One TTT step (forward + backward, fp32, the default world's ttt_steps) of a random drafter of each family at the
   default world's width and at a wider one, each in a fresh subprocess: median time of --steps steps and the peak
   RSS the steps add (VmHWM after the steps minus before them), both beside the EAGLE-3 drafter of the same width.

    .venv/bin/python bench/families.py                 # both parts (~20 min on 2 cores; cached runs take seconds)
    .venv/bin/python bench/families.py --write         # and the figure blocks in docs/families.md
    .venv/bin/python bench/families.py --only-step     # part 2 alone (~1 min)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from stages.common.contract.runtime import set_process_defaults  # noqa: E402

set_process_defaults()

FAMILIES = ("eagle3", "eagle3.1", "mla", "mla3.1")
RUN_FIGURES = (("phase0/accept_len", "phase 0"), ("phase1/accept_len", "phase 1"), ("scratch/accept_len", "scratch"),
               ("phase0/loss_0", "loss_0 as-is"), ("phase1/loss_0", "loss_0 remap"),
               ("diagnose/remap_loss_0", "held-out remap"), ("diagnose/realign_loss_0", "held-out realign"))
WIDTHS = ((128, 4, 2048), (1024, 8, 8192))  # (hidden, heads, draft vocab): the default world's, and a wider one


def run_family(family: str, outputs: Path) -> dict:
    """The default pipeline for `family`; its summary's headline numbers."""
    command = [sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", f"source.build.family={family}"]
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"regraft source.build.family={family} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    runs = [run for run in (outputs / "runs").iterdir() if run.stat().st_mtime >= started - 1]
    summary = json.loads((max(runs, key=lambda run: run.stat().st_mtime) / "summary.json").read_text())
    return {"numbers": summary["numbers"], "commit": summary.get("git_commit", "")}


STEP_CHILD = r"""
import json, resource, statistics, sys, time
import torch
from stages.common.drafter.config import DrafterConfig, FAMILY_FLAGS, MLA_LATENT
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.drafter.target import TargetSignals
from stages.common.drafter.ttt import draft_vocab_ids, ttt_forward
from stages.common.drafter.vocab import VocabMap

family, hidden, heads, draft, steps, ttt = sys.argv[1], *map(int, sys.argv[2:7])
torch.manual_seed(0)
torch.set_num_threads(1)
vocab, B, T = 4 * draft, 4, 128
layer = {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
         "intermediate_size": 4 * hidden, "vocab_size": vocab, "num_hidden_layers": 1}
if family.startswith("mla"):
    layer.update(model_type="deepseek_v2", q_lora_rank=hidden, qk_nope_head_dim=hidden // heads,
                 v_head_dim=hidden // heads, **MLA_LATENT)
config = DrafterConfig(layer=layer, draft_vocab_size=draft, **FAMILY_FLAGS[family])
ids = torch.randperm(vocab)[:draft].sort().values
drafter = Eagle3Drafter.initialised(config, VocabMap.from_target_ids(ids, vocab))
embedding = torch.nn.Embedding(vocab, hidden)
input_ids, mask = torch.randint(0, vocab, (B, T)), torch.ones(B, T)
aux, logits = torch.randn(B, T, 3 * hidden), torch.randn(B, T, vocab)
signals = TargetSignals.from_logits(logits, draft_vocab_ids(drafter))

def hwm_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024

def step():
    stats = ttt_forward(drafter, embedding, input_ids, mask, aux, signals, ttt)
    stats.loss.backward()
    drafter.zero_grad(set_to_none=True)

before = hwm_mb()
times = []
for _ in range(steps + 1):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
params = sum(p.numel() for p in drafter.parameters())
print(json.dumps({"seconds": statistics.median(times[1:]), "added_mb": hwm_mb() - before, "params": params}))
"""


def step_cost(family: str, hidden: int, heads: int, draft: int, steps: int, ttt_steps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", STEP_CHILD, family, str(hidden), str(heads), str(draft), str(steps),
                           str(ttt_steps)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"TTT step of {family} at hidden {hidden} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def runs_table(results: dict[str, dict]) -> str:
    header = "| family | " + " | ".join(label for _, label in RUN_FIGURES) + " |"
    lines = [header, "|" + "---|" * (len(RUN_FIGURES) + 1)]
    for family, result in results.items():
        lines.append(f"| {family} | " + " | ".join(fmt(result["numbers"].get(name)) for name, _ in RUN_FIGURES) + " |")
    return "\n".join(lines)


def steps_table(costs: dict[tuple[str, int], dict], ttt_steps: int) -> str:
    lines = [f"| family | hidden | params | s per TTT step ({ttt_steps} steps, fwd+bwd) | vs eagle3 | peak RSS added MB "
             "| vs eagle3 |", "|---|---|---|---|---|---|---|"]
    for (family, hidden), cost in costs.items():
        base = costs[("eagle3", hidden)]
        lines.append(f"| {family} | {hidden} | {cost['params'] / 1e6:.2f} M | {cost['seconds']:.3f} | "
                     f"{cost['seconds'] / base['seconds']:.2f}x | {cost['added_mb']:.0f} | "
                     f"{cost['added_mb'] / max(base['added_mb'], 1e-9):.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=Path, default=ROOT / "outputs")
    parser.add_argument("--steps", type=int, default=5, help="timed TTT steps per family and width (after one warm-up)")
    parser.add_argument("--ttt-steps", type=int, default=5, help="the default world's finetune.ttt_steps")
    parser.add_argument("--only-step", action="store_true", help="the TTT step costs alone")
    parser.add_argument("--write", action="store_true", help="write the figure blocks into docs/families.md")
    args = parser.parse_args()
    from figures import write_blocks, written  # bench/figures.py, beside this file

    blocks = {}
    if not args.only_step:
        results = {family: run_family(family, args.outputs) for family in FAMILIES}
        blocks["families-runs"] = runs_table(results) + "\n\n" + written("bench/families.py --write") + ".\n"
        print(runs_table(results))
    costs = {(family, hidden): step_cost(family, hidden, heads, draft, args.steps, args.ttt_steps)
             for hidden, heads, draft in WIDTHS for family in FAMILIES}
    print(steps_table(costs, args.ttt_steps))
    blocks["families-step"] = (steps_table(costs, args.ttt_steps) + "\n\n" + written("bench/families.py --write") +
                               f", batch 4 x 128 tokens, 1 thread, median of {args.steps} steps.\n")
    if args.write:
        print("wrote", ", ".join(str(page.relative_to(ROOT)) for page in write_blocks(blocks)) or "nothing new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
