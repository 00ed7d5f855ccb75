"""Benchmark: three vLLM engines asked for at once (a pipeline's probe, evaluate and baseline_evaluate jobs), started
side by side (the default) or one at a time (`vllm.serial_start=true`).

Each case starts three `VllmEngine`s from three threads (each its own engine-venv worker process, as three jobs
have) on a tiny Llama target with vLLM-sized heads, and reports when each was up, from the moment all three were
asked for, and the time until all three were. The pipeline waits for its slowest evaluation, so the last column is
the one that counts.

    .venv/bin/python bench/engine_start.py [--engines 3]
    .venv/bin/python bench/engine_start.py --pipeline outputs --write engine-start   # and the default run's probes
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from stages.common.engines.vllm_engine import VllmConfig, VllmEngine  # noqa: E402
from stages.world.toy import tiny_llama, train_tokenizer  # noqa: E402
from stages.world.corpus import stdlib_docstrings  # noqa: E402


def start_all(target: Path, count: int, serial: bool, logs: Path) -> list[float]:
    """Seconds from the common ask until each engine was up (sorted)."""
    ready: list[float] = []
    engines: list[VllmEngine] = []
    asked = time.monotonic()

    def start(index: int) -> None:
        engine = VllmEngine(VllmConfig(serial_start=serial), logs / f"{serial}-{index}.log")
        engines.append(engine)
        engine.__enter__()
        engine.start(target)
        ready.append(time.monotonic() - asked)

    threads = [threading.Thread(target=start, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for engine in engines:
        engine.stop()
    return sorted(ready)


def regraft(outputs: Path, *overrides: str) -> dict:
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}",
                           "tracking.enabled=false", *overrides], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"regraft failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    run = sorted((outputs / "runs").iterdir(), key=lambda path: path.stat().st_mtime)[-1]
    return json.loads((run / "summary.json").read_text())


def pipeline_case(outputs: Path, serial: bool) -> tuple[list[float], float]:
    """The default run with its three probes on vLLM and everything else cached, so the three start as jobs side by
    side: each probe's import + start-up seconds, and the run's wall seconds."""
    import shutil

    shutil.rmtree(outputs / "cache" / "probe", ignore_errors=True)  # the probes run again, all else is a hit
    summary = regraft(outputs, "probe.backend=vllm", f"probe.vllm.serial_start={str(serial).lower()}")
    probes = [summary["stages"][name] for name in ("probe", "evaluate", "baseline_evaluate")]
    assert not any(probe["hit"] for probe in probes), "a probe was cached: give each case its own settings"
    return sorted(p["metrics"]["import_seconds"] + p["metrics"]["startup_seconds"] for p in probes), \
        summary["wall_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--pipeline", type=Path, metavar="OUTPUTS",
                        help="also the default run's three vLLM probes, in this outputs folder")
    parser.add_argument("--write", metavar="NAME", help="also write the report into the figure block NAME (docs/)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-engine-start-"))
    docs = [doc.text for doc in list(stdlib_docstrings())[:200]]
    target = tiny_llama(train_tokenizer(docs, 512, root / "tokenizer"), root / "target", hidden_size=64,
                        num_layers=4, num_heads=2)
    lines = [f"| case | start | seconds until each is up | all up |", "|---|---|---|---|"]
    for serial in (False, True):
        ready = start_all(target, args.engines, serial, root)
        lines.append(f"| {args.engines} plain engines, tiny Llama | {'one at a time' if serial else 'side by side'} | "
                     f"{', '.join(f'{s:.0f}' for s in ready)} | {ready[-1]:.0f} |")
    if args.pipeline:
        regraft(args.pipeline)  # every fine-tune cached first
        lines += ["", "| case | start | import + start-up of each probe | the run's wall |", "|---|---|---|---|"]
        for serial in (False, True):
            starts, wall = pipeline_case(args.pipeline, serial)
            lines.append(f"| the default run's 3 vLLM probes | {'one at a time' if serial else 'side by side'} | "
                         f"{', '.join(f'{s:.0f}' for s in starts)} | {wall:.0f} |")
    text = "\n".join(lines) + "\n"
    Console().print(text)
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        from figures import write_blocks, written  # bench/figures.py, beside this file

        command = "bench/engine_start.py" + (" --pipeline OUTPUTS" if args.pipeline else "") + f" --write {args.write}"
        write_blocks({args.write: text + "\n" + written(command) + "\n"})


if __name__ == "__main__":
    main()
