"""Benchmark: where a warm rerun's seconds go (every stage a cache hit), part by part, for one or more checkouts;
and how long the other commands a user repeats take (`--cfg job`, a plan, a refused bad input).

A warm rerun is the command a user repeats most (checking a sweep, rerunning after a fix, reading the tables
again). This runs `regraft` on an outputs folder whose stages are all complete: once after asking the store's agent
to end (pipelines/tracking/store_agent.py: that command starts a new one, as the first command after an idle spell
does), then `--repeat` times plain (the wall seconds, median), then once under cProfile, whose main-thread cumulative
seconds give the parts. With several `--root`s (a worktree of an earlier commit beside this one) the table sets
them side by side: on one `--outputs` when the stages' code is the same in each (else the rerun is not warm), or on
one `--outputs` per root, each the outputs of that checkout's own cold run.

    .venv/bin/python -m pipelines.regraft paths.outputs=/tmp/warm              # once: the cold run
    .venv/bin/python bench/warm_rerun.py --outputs /tmp/warm                   # this checkout
    .venv/bin/python bench/warm_rerun.py --outputs /tmp/tiny --override debug=tiny  # a debug=tiny cold run's
    git worktree add /tmp/before COMMIT
    .venv/bin/python bench/warm_rerun.py --outputs /tmp/warm --root /tmp/before --root .
    .venv/bin/python bench/warm_rerun.py --outputs /tmp/warm_before --root /tmp/before --outputs /tmp/warm --root .
"""
from __future__ import annotations

import argparse
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.figures import code_commit, cpu_model  # noqa: E402

# (part, file suffix or suffixes, function): cumulative main-thread seconds of that function (summed over its calls)
PARTS = (
    ("import torch", "site-packages/torch/__init__.py", "<module>"),
    ("import mlflow", "site-packages/mlflow/__init__.py", "<module>"),
    ("tracking set up (store opened)", "pipelines/tracking/tracker.py", "for_pipeline"),
    ("  of which the store's agent reached", "pipelines/tracking/store_agent.py", "reach"),
    ("config composed (Hydra)", "hydra/_internal/hydra.py", "compose_config"),
    ("cache keys", "pipelines/core/cache.py", "keys_for"),
    ("DAG: hits checked and recorded", "pipelines/core/runner.py", "run_dag"),
    ("waiting for the store at the end", ("pipelines/tracking/outbox.py", "pipelines/tracking/store_agent.py"), "close"),
    ("plots", "pipelines/report/summary.py", "plot"),
)


# the other commands a user repeats, timed whole (median of --repeat): (row, overrides, the exit code expected)
QUICK = (("regraft --cfg job", ["--cfg", "job"], 0), ("regraft pipeline.plan=true", ["pipeline.plan=true"], 0),
         ("a refused bad input (finetune.lr=-1)", ["finetune.lr=-1"], 1))


OVERRIDES: list[str] = []  # --override: given to every command (debug=tiny for a tiny cold run's outputs)


def command(root: Path, outputs: Path, profile: Path | None, extra: list[str] = ()) -> list[str]:
    profiled = ["-m", "cProfile", "-o", str(profile)] if profile else []
    return [sys.executable, *profiled, "-m", "pipelines.regraft", f"paths.outputs={outputs}", *OVERRIDES, *extra]


def rerun(root: Path, outputs: Path, profile: Path | None = None, extra: list[str] = (), expect: int = 0) -> float:
    env = {**os.environ, "PYTHONPATH": str(root)}
    started = time.perf_counter()
    done = subprocess.run(command(root, outputs, profile, extra), cwd=root, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != expect:
        raise SystemExit(f"regraft {' '.join(extra)} in {root} exited {done.returncode}:\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    return seconds


def parts(profile: Path) -> dict[str, tuple[float, int]]:
    stats = pstats.Stats(str(profile)).stats
    found = {}
    for name, suffix, function in PARTS:
        hits = [value for key, value in stats.items() if key[0].endswith(suffix) and key[2] == function]
        found[name] = (sum(value[3] for value in hits), sum(value[1] for value in hits))
    return found


def ran_nothing(outputs: Path) -> bool:
    import json

    summary = sorted((outputs / "runs").glob("*/summary.json"), key=lambda path: path.parent.name)[-1]
    return all(stage["hit"] for stage in json.loads(summary.read_text())["stages"].values())


def measure(root: Path, outputs: Path, repeat: int) -> dict:
    from pipelines.tracking.store_agent import stop_agents

    stop_agents(str(outputs))  # the first command after the store's agent ended (idle) starts one
    first = rerun(root, outputs)
    walls = [rerun(root, outputs) for _ in range(repeat)]
    if not ran_nothing(outputs):
        raise SystemExit(f"the rerun in {root} ran stages: its stage code differs from the cold run's")
    quick = {name: statistics.median(rerun(root, outputs, extra=extra, expect=code) for _ in range(repeat))
             for name, extra, code in QUICK}
    with tempfile.TemporaryDirectory() as folder:
        profile = Path(folder) / "warm.prof"
        rerun(root, outputs, profile)
        return {"wall": statistics.median(walls), "first": first, "parts": parts(profile), "quick": quick}


def short(commit: str) -> str:
    """`code_commit`'s answer in a column: 8 hex digits, and -dirty where it is."""
    return commit[:8] + ("-dirty" if commit.endswith("-dirty") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=Path, action="append", required=True,
                        help="an outputs folder whose stages are complete: one for every root, or one per root")
    parser.add_argument("--root", type=Path, action="append", help="a checkout to measure (default: this one)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--override", action="append", default=[],
                        help="an override every command takes, as the cold run did (e.g. debug=tiny)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/results.md (warm-rerun)")
    args = parser.parse_args()
    OVERRIDES.extend(args.override)
    roots = [root.resolve() for root in (args.root or [ROOT])]
    if len(args.outputs) not in (1, len(roots)):
        parser.error(f"give one --outputs, or one per --root ({len(roots)})")
    outputs = args.outputs * len(roots) if len(args.outputs) == 1 else args.outputs
    results = {root: measure(root, folder, args.repeat) for root, folder in zip(roots, outputs)}
    text = table(results, [short(code_commit(root)) for root in roots])
    print(text)
    if args.write:
        from bench.figures import write_blocks

        said = (f"Written by `bench/warm_rerun.py --write` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores of "
                f"{cpu_model()}, "
                f"{args.repeat} plain reruns per checkout) on a default run's outputs (each checkout's own where "
                "their stages' code differs). Parts are main-thread cumulative seconds under cProfile, which slows "
                "Python code; they overlap where one part runs inside another (the DAG records its hits through "
                "tracking).")
        write_blocks({"warm-rerun": "```\n" + text + "\n```\n\n" + "\n".join(textwrap.wrap(said, 118)) + "\n"})


def table(results: dict[Path, dict], names: list[str]) -> str:
    width = max(len(name) for name, _, _ in PARTS + QUICK) + 18
    lines = [f"{'seconds':<{width}}" + "".join(f"{name:>14}" for name in names),
             f"{'warm rerun, wall (median)':<{width}}" + "".join(f"{r['wall']:>14.2f}" for r in results.values()),
             f"{'  the one that starts the agent':<{width}}"
             + "".join(f"{r['first']:>14.2f}" for r in results.values())]
    for name, _, _ in PARTS:
        cells = []
        for result in results.values():
            seconds, calls = result["parts"][name]
            cells.append(f"{seconds:.2f}" + (f" ({calls}x)" if calls > 1 else ""))
        lines.append(f"{name:<{width}}" + "".join(f"{cell:>14}" for cell in cells))
    lines.append("")
    for name, _, _ in QUICK:
        lines.append(f"{name + ', wall (median)':<{width}}" + "".join(f"{r['quick'][name]:>14.2f}"
                                                                      for r in results.values()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
