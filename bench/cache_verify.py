"""What checking a cache hit costs (pipelines/core/cache.py CacheCheck): sha256 throughput here, and every policy on the
outputs of a run.

    .venv/bin/python bench/cache_verify.py                  # the newest run under outputs/runs (`make run` first)
    .venv/bin/python bench/cache_verify.py --run DIR        # a given run folder
    .venv/bin/python bench/cache_verify.py --write          # and its cache-verify block (docs/results.md)

For each stage output of the run: its files and bytes, then the wall time of `size` (a stat per file) and `hash`
(every file's sha256) checks, best of 3 (the files are in the page cache after the first read: a cold disk reads
at its own speed, which this does not measure). The last line extrapolates the measured throughput to 1 TB of
features, what `auto` spares a hit above `cache.hash_limit_gb`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.core.cache import CacheCheck  # noqa: E402
from pipelines.schema import CacheConfig  # noqa: E402
from stages.common.contract.artifacts import read_manifest, sha256_of  # noqa: E402
from figures import newest_run  # noqa: E402  (bench/figures.py, beside this file)

PROBE_BYTES = 256 * 2**20


def best_of(repeats: int, call) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def sha256_gb_s() -> float:
    with tempfile.NamedTemporaryFile(dir=ROOT / "outputs") as scratch:
        scratch.write(os.urandom(PROBE_BYTES))
        scratch.flush()
        seconds = best_of(3, lambda: sha256_of(Path(scratch.name)))
    return PROBE_BYTES / seconds / 1e9


def rows_of(run: Path) -> list[tuple[str, int, int, float, float]]:
    """(node, files, bytes, size-check ms, hash-check ms) for every distinct output of the run."""
    summary = json.loads((run / "summary.json").read_text())
    rows, seen = [], set()
    for name, stage in summary["stages"].items():
        out = Path(stage["out"])
        manifest = read_manifest(out)
        if out in seen or manifest is None or "checksums" not in manifest:
            continue
        seen.add(out)
        checksums = manifest["checksums"]
        size_s = best_of(3, lambda: CacheCheck(verify="size").problem(out))
        hash_s = best_of(3, lambda: CacheCheck(verify="hash").problem(out))
        rows.append((name, len(checksums), sum(c["bytes"] for c in checksums.values()), size_s * 1e3, hash_s * 1e3))
    return rows


def table(run: Path, rows: list, gb_s: float) -> str:
    lines = [f"Outputs of {run.name} (`bench/cache_verify.py`), checked as a hit checks them:", "",
             "| stage output | files | MB | size check ms | hash check ms |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {files} | {size / 1e6:.1f} | {size_ms:.2f} | {hash_ms:.1f} |"
              for name, files, size, size_ms, hash_ms in rows]
    total = [sum(row[i] for row in rows) for i in (1, 2, 3, 4)]
    lines.append(f"| **all {len(rows)}** | {total[0]} | {total[1] / 1e6:.1f} | {total[2]:.2f} | {total[3]:.1f} |")
    terabyte_min = 1e12 / (gb_s * 1e9) / 60
    lines += ["", f"sha256 here: {gb_s:.2f} GB/s (one core, from the page cache); at that rate 1 TB of features "
                  f"takes {terabyte_min:.0f} min to hash on every hit, which `auto` does only for outputs up to "
                  f"`cache.hash_limit_gb` ({CacheConfig().hash_limit_gb:g} GB by default)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run folder with summary.json (default: the newest run)")
    parser.add_argument("--outputs", type=Path, default=ROOT / "outputs")
    parser.add_argument("--write", "--readme", action="store_true",
                        help="write the table into its figures block (README.md or docs/, wherever it stands)")
    args = parser.parse_args()
    run = args.run or newest_run(args.outputs)
    block = table(run, rows_of(run), sha256_gb_s())
    print(block)
    if args.write:
        from figures import write_blocks, written  # bench/figures.py, beside this file

        changed = write_blocks({"cache-verify": f"{block}\n{written('bench/cache_verify.py --write')}.\n"})
        print("figures:cache-verify: " + (f"{changed[0].relative_to(ROOT)} written" if changed else "unchanged"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
