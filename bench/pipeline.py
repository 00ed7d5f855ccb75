"""Benchmark: what running the pipeline's stages as submitit jobs costs beyond the stages' own work.

Each case runs `regraft` (launcher=local) as a user does, in a fresh output folder, then once more with every
stage cached, and reads `summary.json`: per stage, its own seconds (inside the job, after imports) and its wall
seconds (from the orchestrator's decision to run it until its result is tracked in MLflow). The difference is the
orchestration overhead: starting the job's processes, imports, the job's pickles, polling, MLflow.

  cold   a fresh interpreter per job (launcher.warm=false): every job imports torch and the stages itself
  warm   jobs fork from one interpreter that imported them once (launcher.warm=true, the default)

    .venv/bin/python bench/pipeline.py                   # the tiny world of the tests: ~3 minutes
    .venv/bin/python bench/pipeline.py --size default    # `make run` itself, warm launcher only: ~5 minutes
    .venv/bin/python bench/pipeline.py --cases warm --keep
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

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]

CASES = {"cold": ["launcher.warm=false"], "warm": ["launcher.warm=true"]}


def regraft(outputs: Path, overrides: list[str]) -> tuple[float, dict]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", *overrides],
                          cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"regraft failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    run = sorted((outputs / "runs").iterdir())[-1]
    return seconds, json.loads((run / "summary.json").read_text())


def stage_rows(summary: dict) -> list[tuple[str, float, float]]:
    return [(name, stage["seconds"], stage["overhead_seconds"])
            for name, stage in summary["stages"].items() if not stage["hit"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--cases", nargs="+", choices=tuple(CASES), default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the output folders")
    args = parser.parse_args()
    cases = args.cases or (["cold", "warm"] if args.size == "tiny" else ["warm"])
    sizes = ["debug=tiny"] if args.size == "tiny" else []
    workdir = Path(tempfile.mkdtemp(prefix="bench-pipeline-", dir=args.workdir))
    console = Console(width=120)
    per_stage = Table(title=f"regraft stages as local jobs ({args.size} world, {os.cpu_count()} cores)")
    per_stage.add_column("stage")
    for case in cases:
        per_stage.add_column(f"{case}: stage s", justify="right")
        per_stage.add_column(f"{case}: overhead s", justify="right")
    totals = Table(title="whole runs")
    for column in ("case", "first run s", "stages run", "overhead mean s", "overhead max s", "all cached s"):
        totals.add_column(column, justify="left" if column == "case" else "right")
    rows: dict[str, list[str]] = {}
    try:
        for case in cases:
            outputs = workdir / case
            load = os.getloadavg()[0]
            first, summary = regraft(outputs, [*sizes, *CASES[case]])
            again, cached = regraft(outputs, [*sizes, *CASES[case]])
            assert not stage_rows(cached), "the second run ran stages"
            stages = stage_rows(summary)
            for name, seconds, overhead in stages:
                rows.setdefault(name, []).extend([f"{seconds:.2f}", f"{overhead:.2f}"])
            overheads = [overhead for _, _, overhead in stages]
            totals.add_row(f"{case} (load {load:.1f})", f"{first:.1f}", str(len(stages)),
                           f"{sum(overheads) / len(overheads):.2f}", f"{max(overheads):.2f}", f"{again:.1f}")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    for name, cells in rows.items():
        per_stage.add_row(name, *cells)
    console.print(per_stage)
    console.print(totals)
    if args.keep:
        console.print(f"outputs kept in {workdir}")


if __name__ == "__main__":
    main()
