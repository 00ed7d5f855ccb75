"""accept_len both ways for a run: the pooled figure (regraft's headline, vLLM's and SpecForge's benchmarker's way)
and the mean of per-request figures (a benchmark averaging SGLang's per-request `spec_accept_length`), with the
per-position acceptance rates, for phase 0, phase 1 and the scratch baseline, and whether the two rank them alike.

    .venv/bin/python bench/accept_both.py                  # the newest run under outputs/runs
    .venv/bin/python bench/accept_both.py --run DIR --write   # into docs/results.md's figures:accept-both block

Who reports which, with the source lines: docs/engines.md ("accept_len, pooled and per request").
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.figures import cpu_model, newest_run, write_blocks, written  # noqa: E402
from pipelines.report.summary import accept_len_orders  # noqa: E402

PHASES = (("phase0", "probe", "source as it is"), ("phase1", "evaluate", "fine-tuned"),
          ("scratch", "baseline_evaluate", "from scratch"))


def rows(summary: dict) -> list[tuple[str, ...]]:
    """One row per phase the run measured: pooled, per-request mean, and each draft position's acceptance rate."""
    table = []
    for phase, node, meaning in PHASES:
        metrics = summary["stages"].get(node, {}).get("metrics", {})
        if "accept_len" not in metrics or "accept_len_per_request" not in metrics:
            continue
        steps = int(metrics["num_steps"])
        rates = " / ".join(f"{metrics[f'accept_rate_{k + 1}']:.3f}" for k in range(steps))
        table.append((f"{phase} ({meaning})", f"{metrics['accept_len']:.3f}",
                      f"{metrics['accept_len_per_request']:.3f}", rates, str(int(metrics["turns"]))))
    return table


def block(run: Path, summary: dict, command: str) -> str:
    head = ("phase", "pooled", "per-request mean", "accepted at position 1 / 2 / ...", "turns")
    table = [head, *rows(summary)]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["   ".join(cell.ljust(width) if i in (0, 3) else cell.rjust(width) for i, (cell, width) in
                       enumerate(zip(row, widths))).rstrip() for row in table]
    orders = accept_len_orders(summary["numbers"]) or "the pooled figure and the per-request mean rank the phases alike"
    said = (f"Run `{run.name}` (overrides: {' '.join(summary.get('overrides', [])) or 'none'}) on {cpu_model()}: "
            f"{orders}. {written(command)}.")
    wrapped = textwrap.wrap(said, width=118, break_on_hyphens=False)
    return "```\n" + "\n".join(lines) + "\n```\n\n" + "\n".join(wrapped) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run folder with summary.json (default: the newest run)")
    parser.add_argument("--outputs", type=Path, default=ROOT / "outputs")
    parser.add_argument("--write", action="store_true", help="write the block into docs/results.md")
    args = parser.parse_args()
    run = args.run or newest_run(args.outputs)
    summary = json.loads((run / "summary.json").read_text())
    if not rows(summary):
        raise SystemExit(f"{run}: no probe or evaluate reports accept_len_per_request (a run older than it)")
    text = block(run, summary, "bench/accept_both.py --write")
    print(text)
    if args.write:
        write_blocks({"accept-both": text})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
