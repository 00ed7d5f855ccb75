"""The vLLM and SGLang versions regraft's engine adapters were checked against, and how: docs/engines.md's table.

Checks stages/common/engines/engine_surface.py's list (what the adapters reach) against each engine it can find:
- the engine venv's vLLM imported (`.venv-vllm`, the CPU build: engine_api_check, run by that interpreter), and its
  source read (engine_source_check over its site-packages);
- a wheel's source, read without importing it (a GPU build on this CPU machine): `--wheel` or the variables
  REGRAFT_VLLM_WHEEL and REGRAFT_SGLANG_WHEEL (`pip download vllm==0.33.0 --no-deps -d /tmp/vllm033`);
and prints one row per engine and version, what fails, and what differs between vLLM versions.

    python bench/engine_surface.py --wheel /tmp/vllm033/vllm-0.33.0-*.whl --wheel /tmp/sglang/sglang-0.5.23-*.whl
    python bench/engine_surface.py --wheel ... --write     # the table into docs/engines.md (figures:engine-versions)
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.common.contract.artifacts import installed_distribution, venv_site_packages  # noqa: E402
from stages.common.engines.engine_api_check import run_in  # noqa: E402
from stages.common.engines.engine_source_check import check_source, differences  # noqa: E402
from stages.common.engines.engine_surface import CHECKED, SURFACE  # noqa: E402
from stages.common.engines.vllm_engine import VllmConfig, engine_python  # noqa: E402

WHEEL_VARIABLES = {"vllm": "REGRAFT_VLLM_WHEEL", "sglang": "REGRAFT_SGLANG_WHEEL"}


def wheel_engine(path: Path) -> str:
    return path.name.split("-")[0].lower()


def reports(wheels: list[Path]) -> list[tuple[str, str, dict]]:
    """(build, how, report) for the engine venv (imported, and its source) and each wheel (source)."""
    found = []
    python = engine_python(VllmConfig())
    if python.exists():
        name, version = installed_distribution("vllm", python)
        found.append((f"{name} {version}", "imported: signatures, fields, make_arg_parser", run_in(python)))
        found.append((f"{name} {version}", "source (site-packages)", check_source(venv_site_packages(python), "vllm")))
    for wheel in wheels:
        report = check_source(wheel, wheel_engine(wheel))
        found.append((wheel.name.split("-")[0] + f" {report['version']}", f"source only ({wheel.name})", report))
    return found


def table(found: list[tuple[str, str, dict]], commit: str) -> str:
    kinds = collections.Counter(reach.kind for reach in SURFACE)
    lines = ["| engine | build | how checked | reaches ok | missing | moved | date | commit |", "|---|---|---|---|---|---|---|---|"]
    today = datetime.date.today().isoformat()
    for build, how, report in found:
        counts = collections.Counter(result["status"] for result in report["results"])
        lines.append(f"| {report['engine']} | {build} | {how} | {counts['ok']} of {len(report['results'])} | "
                     f"{counts['missing']} | {counts['moved']} | {today} | `{commit[:12]}` |")
    text = "\n".join(lines) + "\n\n"
    text += (f"The surface: {len(SURFACE)} reaches ({', '.join(f'{n} {k}' for k, n in kinds.most_common())}); "
             f"the checked range preflight holds an engine to: "
             f"{'; '.join(f'{e} {lo} to {hi}' for e, (lo, hi) in CHECKED.items())}.\n")
    for build, how, report in found:
        for result in report["results"]:
            if result["status"] != "ok":
                text += f"- {build}, {result['status']}: {result['name']} ({result['detail']})\n"
    sources = {report["version"]: report for build, how, report in found
               if report["engine"] == "vllm" and how.startswith("source")}
    if len(sources) >= 2:
        old, new = sorted(sources, key=lambda v: tuple(int(x) for x in v.split("+")[0].split(".")))[:2]
        diff = differences(sources[old], sources[new])
        text += f"\nvLLM {old} -> {new}, read from both sources: " + (
            f"{len(diff)} reach(es) found elsewhere:\n" + "".join(f"- {line}\n" for line in diff) if diff else
            "every reach found in the same place.\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, action="append", default=[], help="an engine wheel (repeatable)")
    parser.add_argument("--write", action="store_true", help="write the table into docs/engines.md")
    args = parser.parse_args()
    wheels = args.wheel + [Path(os.environ[v]) for v in WHEEL_VARIABLES.values() if os.environ.get(v)]
    sys.path.insert(0, str(Path(__file__).parent))
    from figures import code_commit, write_blocks, written  # bench/figures.py, beside this file

    text = table(reports(list(dict.fromkeys(wheels))), code_commit())
    print(text)
    if args.write:
        command = "bench/engine_surface.py " + " ".join(f"--wheel {w.name}" for w in wheels) + " --write"
        write_blocks({"engine-versions": text + "\n" + written(command) + "\n"})


if __name__ == "__main__":
    main()
