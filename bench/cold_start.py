"""Benchmark: a new user's first `make run`, from a fresh clone: the install, then the whole default pipeline.

Clones this checkout's HEAD into a temporary folder (the committed code only, as CI and a new user get it), runs
`make venv` and then `make run` there, each timed whole (the install with empty package caches, as on a fresh
machine: uv's in a new folder, pip's off), and reads the run's `summary.json`: the pipeline's own wall
seconds and each stage's (stages overlap: up to `launcher.max_parallel` run at once). The machine should be idle:
both commands use every core. `--write` puts the table into docs/results.md (block `cold-start`).

    .venv/bin/python bench/cold_start.py              # ~8 minutes on 2 cores
    .venv/bin/python bench/cold_start.py --write --keep
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.figures import code_commit, cpu_model, newest_run, write_blocks  # noqa: E402


def timed(command: list[str], cwd: Path) -> float:
    fresh_caches = {"UV_CACHE_DIR": str(cwd.parent / "uv-cache"), "PIP_NO_CACHE_DIR": "1"}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **fresh_caches, "ARGS": ""})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {cwd}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def table(install: float, run: float, summary: dict) -> str:
    lines = [f"{'step':<40}{'seconds':>9}",
             f"{'make venv (the install)':<40}{install:>9.1f}",
             f"{'make run (the default pipeline)':<40}{run:>9.1f}",
             f"{'  of which the pipeline itself':<40}{summary['wall_seconds']:>9.1f}",
             f"{'both: a fresh clone to the first table':<40}{install + run:>9.1f}", "",
             f"{'stage (its own seconds, in its job)':<40}{'seconds':>9}"]
    lines += [f"{name:<40}{stage['seconds']:>9.1f}" for name, stage in summary["stages"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the table into docs/results.md (cold-start)")
    parser.add_argument("--keep", action="store_true", help="keep the clone (its .venv and outputs)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    commit = code_commit(ROOT)
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    clone = Path(tempfile.mkdtemp(prefix="bench-cold-", dir=args.workdir)) / "regraft"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    try:
        install = timed(["make", "venv"], clone)
        run = timed(["make", "run"], clone)
        summary = json.loads((newest_run(clone / "outputs") / "summary.json").read_text())
        text = table(install, run, summary)
        print(text)
        if args.write:
            said = (f"Written by `bench/cold_start.py --write` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores of "
                    f"{cpu_model()}) from a fresh clone of commit {commit.removesuffix('-dirty')} (the committed code "
                    "only), the install with empty package caches.")
            write_blocks({"cold-start": "```\n" + text + "\n```\n\n" + "\n".join(textwrap.wrap(said, 118)) + "\n"})
    finally:
        if args.keep:
            print(f"kept: {clone}")
        else:
            shutil.rmtree(clone.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
