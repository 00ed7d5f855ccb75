"""Benchmark: how close `pipeline.plan=true` comes to the run it plans, on this machine.

Runs the default pipeline (cached stages take seconds), then plans the same config, and sets the plan's figures
beside what the stages wrote: the features' tokens and bytes against their manifest, the fine-tunes' checkpoint
bytes against their folders, and the plan's device time on `cpu` (FLOPs over the matrix-product rate measured
here) against each stage's own seconds (its manifest's span).

    .venv/bin/python bench/plan.py [--outputs DIR] [OVERRIDE ...]
    .venv/bin/python bench/plan.py --write plan-vs-run       # the figure block in docs/plan.md
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES = ("features", "source_drafter", "finetune", "baseline_finetune", "probe", "evaluate", "baseline_evaluate")


def regraft(outputs: Path, *overrides: str) -> Path:
    """The run folder of one regraft call."""
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", *overrides],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"regraft {' '.join(overrides)} failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    runs = [run for run in (outputs / "runs").iterdir() if run.stat().st_mtime >= started - 1]
    return max(runs, key=lambda run: run.stat().st_mtime)


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def computed_seconds(outputs: Path) -> dict[str, float]:
    """Each cache key's seconds in the run that computed it (its summary's stage, not a hit)."""
    seconds = {}
    for path in sorted((outputs / "runs").glob("*/summary.json")):
        for stage in json.loads(path.read_text()).get("stages", {}).values():
            if not stage["hit"]:
                seconds[stage["key"]] = stage["seconds"]
    return seconds


def measured(stage: dict, seconds: dict[str, float]) -> dict:
    out = Path(stage["out"])
    manifest = json.loads((out / "manifest.json").read_text())
    checkpoints = out.with_name(out.name + ".checkpoints")
    return {"seconds": seconds.get(stage["key"]), "metrics": manifest["metrics"],
            "checkpoint_bytes": folder_bytes(out / "drafter") + (folder_bytes(checkpoints)
                                                                 if checkpoints.exists() else 0)}


def ratio(planned, actual) -> str:
    return f"{planned / actual:.2f}" if planned is not None and actual else "-"


def rows_of(plan: dict, summary: dict, seconds: dict[str, float]) -> list[list[str]]:
    planned = {row["node"]: row for row in plan["nodes"]}
    rows = []
    for name in NODES:
        if name not in planned or name not in summary["stages"]:
            continue
        row, actual = planned[name], measured(summary["stages"][name], seconds)
        plan_seconds = row["gpu_hours"] * 3600 if row["gpu_hours"] is not None else None
        if name == "features":
            bytes_pair = (row["feature_bytes"], actual["metrics"]["bytes"])
            tokens = f"{row['tokens']:,} / {actual['metrics']['tokens']:,}"
        elif row["stage"] == "finetune":
            bytes_pair, tokens = (row["checkpoint_bytes"], actual["checkpoint_bytes"]), "-"
        else:
            bytes_pair, tokens = (None, None), "-"
        rows.append([name, tokens, ratio(*bytes_pair),
                     f"{plan_seconds:.2f}" if plan_seconds is not None else "?",
                     f"{actual['seconds']:.1f}" if actual["seconds"] is not None else "?",
                     ratio(plan_seconds, actual["seconds"])])
    return rows


def report(rows: list[list[str]], rate: str) -> str:
    head = ["node", "tokens plan / run", "bytes plan / run", "plan s", "run s", "time plan / run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", f"Bytes: the features' shards (features) and the fine-tunes' drafter and DeepSpeed checkpoints "
              f"against their folders. Time: FLOPs over {rate}, against the stage's own seconds in the run that "
              "computed it; the stages "
              "reach a small share of a matrix product's rate on CPU, so the plan's time is a lower bound here."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=Path, default=ROOT / "outputs")
    parser.add_argument("--write", metavar="BLOCK", help="write the table into this figure block")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run = regraft(args.outputs, *args.overrides)
    plan_run = regraft(args.outputs, *args.overrides, "pipeline.plan=true")
    plan = json.loads((plan_run / "plan.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    text = report(rows_of(plan, summary, computed_seconds(args.outputs)), plan["rate"])
    print(text)
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        from figures import write_blocks, written  # bench/figures.py, beside this file

        command = " ".join(["bench/plan.py", "--write", args.write, *args.overrides])
        write_blocks({args.write: text + "\n\n" + written(command) + "\n"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
