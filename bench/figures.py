"""The documented figures, written from a run: never typed by hand, so they cannot drift from what `make run` gives.

    .venv/bin/python bench/figures.py                   # the newest run under outputs/runs (what `make run` wrote)
    .venv/bin/python bench/figures.py --run DIR         # a given run folder (its summary.json)
    .venv/bin/python bench/figures.py --check           # exit 1 if the pages' blocks differ from the run's
    .venv/bin/python bench/figures.py --vllm            # also the evaluate probe on vLLM (about 2 minutes)
    make figures                                        # `make run`, then this

Each block sits between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` in README.md or a page of docs/ (one
block of a name in all of them: `write_blocks` finds it there) and is replaced whole. This script writes two:
- `default-run`: the story table of the run (as `regraft` prints it: each figure beside its MLflow name), the
  world's digest and the CPU settings it was built under, the run's date and commit (the tracker's `git_commit`
  tag, or HEAD when the run has no MLflow store).
- `engines-agree`: the phase-1 drafter's acceptance counts on the held-out prompts (the evaluate stage's report)
  and, with `--vllm`, the same probe run on vLLM's engine (`.venv-vllm`, `make venv-vllm`) beside them: the counts
  the field's own engine gives for the same drafter, prompts and settings.

The run must be a default one (no overrides but `paths.*`): the README describes `make run`. bench/race.py,
bench/cpu_settings.py and bench/cache_verify.py write their own blocks through `write_blocks` too.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.report.summary import story_rows  # noqa: E402

BLOCK = re.compile(r"(<!-- figures:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)


def newest_run(outputs: Path) -> Path:
    runs = sorted((p for p in (outputs / "runs").glob("*/summary.json")), key=lambda p: p.parent.name)
    if not runs:
        raise SystemExit(f"no run with a summary.json under {outputs / 'runs'}: `make run` first")
    return runs[-1].parent


def run_commit(run: Path, summary: dict) -> str:
    """The commit the run's tracker recorded (tag `git_commit` of the parent run tagged with this run_dir)."""
    uri = str(summary["config"].get("tracking", {}).get("uri") or "")
    store = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None  # relative: to where it ran
    if store is not None and store.exists():
        import sqlite3

        with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT c.value FROM tags c JOIN tags d ON c.run_uuid = d.run_uuid WHERE "
                             "c.key = 'git_commit' AND d.key = 'run_dir' AND d.value = ?", (str(run.resolve()),)).fetchone()
        if row:
            return row[0]
    return code_commit() + " (HEAD when the figures were written; the run recorded none)"


def default_run_block(run: Path, summary: dict) -> str:
    rows = story_rows(summary["numbers"])
    widths = [max(len(row[i]) for row in rows + [("measure", "value", "MLflow")]) for i in range(3)]
    lines = [f"{'measure':<{widths[0]}}   {'value':>{widths[1]}}   MLflow"]
    lines += [f"{label:<{widths[0]}}   {value:>{widths[1]}}   {key}" for label, value, key in rows]
    world = json.loads((Path(summary["stages"]["world"]["out"]) / "manifest.json").read_text())
    cpu = world.get("cpu", {})
    when = datetime.datetime.fromtimestamp((run / "summary.json").stat().st_mtime, datetime.timezone.utc)
    said = (f"Run `{run.name}` ({when:%Y-%m-%d}, commit `{run_commit(run, summary)}`, "
            f"{summary['wall_seconds']:.0f} s of wall time). Its world: digest `{world.get('digest', 'none recorded')}`, "
            f"built in {world['metrics']['seconds_total']:.0f} s on {cpu.get('threads', '?')} thread(s) under ATen "
            f"{cpu.get('cpu_capability', '?')} and MKL {cpu.get('mkl_cbwr', '?')} (the same on every x86 CPU of "
            f"one vendor, not yet across vendors: docs/world.md). Written by `bench/figures.py` (`make figures`).")
    return "```\n" + "\n".join(lines) + "\n```\n\n" + "\n".join(textwrap.wrap(said, width=118)) + "\n"


def counts(metrics: dict) -> str:
    steps = int(metrics["num_steps"])
    accepted = [int(metrics[f"accepted_at_{k + 1}"]) for k in range(steps)]
    return (f"{int(metrics['drafts'])} drafts, of which {' / '.join(map(str, accepted))} were accepted at positions "
            f"{' / '.join(str(k + 1) for k in range(steps))}: accept_len {metrics['accept_len']:.3f} (vLLM's own "
            f"definition, 1 + accepted / drafts: {1 + sum(accepted) / max(int(metrics['drafts']), 1):.3f})")


def vllm_evaluate(summary: dict, out: Path) -> dict:
    """The evaluate stage's own config (its manifest), run again with backend=vllm: its metrics."""
    from pipelines.core.jobs import stage_config

    evaluate = Path(summary["stages"]["evaluate"]["out"])
    config = json.loads((evaluate / "manifest.json").read_text())["config"]
    module, cfg = stage_config("probe", {**config, "backend": "vllm", "out": str(out)})
    return module.run(cfg).metrics


def engines_block(summary: dict, vllm: tuple[dict, str] | None) -> str:
    """Inside a list item of docs/results.md: wrapped and indented by two spaces."""
    metrics = summary["stages"]["evaluate"]["metrics"]
    text = (f"The default run's phase-1 drafter on its {int(metrics['turns'])} held-out turns, "
            f"{int(metrics['num_steps'])} draft steps, hf backend (the evaluate stage): {counts(metrics)}")
    if vllm is not None:
        text += f"; the same probe on {vllm[1]}'s engine: {counts(vllm[0])}"
    text += "; written by `bench/figures.py` from the default run in README.md."
    return "\n".join(textwrap.wrap(text, width=118, initial_indent="  ", subsequent_indent="  ")) + "\n"


def on_vllm(summary: dict, out: Path | None) -> tuple[dict, str] | None:
    """The evaluate probe run now on vLLM (`--vllm`): its metrics and the engine's version, from its manifest."""
    if out is None:
        return None
    import shutil

    shutil.rmtree(out, ignore_errors=True)  # a stage output is written once: this run's probe, not an old one
    metrics = vllm_evaluate(summary, out)
    manifest = json.loads((out / "manifest.json").read_text())
    return metrics, f"vllm {manifest.get('engine_versions', {}).get('vllm', '?')}"


def cpu_model() -> str:
    """The CPU's model name, for a figure's provenance (timings differ between CPUs)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "an unknown CPU"


def code_commit(root: Path = ROOT) -> str:
    """HEAD of the checkout at `root`, `-dirty` when a tracked file other than README.md and docs/ differs from it:
    the figure blocks the bench scripts write into those pages do not make the code that computed them another
    commit."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!README.md",
                              ":!docs"], cwd=root, capture_output=True, text=True).stdout.strip()
    return (head or "unknown") + ("-dirty" if changed else "")


def written(command: str) -> str:
    """How a bench script's block says where it came from: the command, today's date and the code's commit."""
    return f"`{command.strip()}`, written by the script on {datetime.date.today()} at commit {code_commit()}"


def pages(root: Path = ROOT) -> list[Path]:
    """Where figure blocks live: README.md and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(text: str, blocks: dict[str, str]) -> str:
    """`text` with each of its blocks named in `blocks` replaced whole; everything else left byte for byte."""
    return BLOCK.sub(lambda m: m[1] + blocks.get(m["name"], m["body"]) + m[4], text)


def write_blocks(blocks: dict[str, str], root: Path = ROOT, check: bool = False) -> list[Path]:
    """Each block written into the one page (README.md, docs/*.md) that holds it; returns the pages whose text
    changes (with `check`, would change: nothing is written). A name no page holds, or held twice, ends the script."""
    texts = {page: page.read_text() for page in pages(root) if page.exists()}
    held = {name: [page for page, text in texts.items() for m in BLOCK.finditer(text) if m["name"] == name]
            for name in blocks}
    wrong = {name: places for name, places in held.items() if len(places) != 1}
    if wrong:
        raise SystemExit("; ".join(
            f"figures:{name}: " + (f"{len(places)} blocks ({', '.join(str(p.relative_to(root)) for p in places)})"
                                   if places else "no <!-- figures:NAME --> block in README.md or docs/*.md")
            for name, places in sorted(wrong.items())) + " (each block stands in exactly one page)")
    changed = []
    for page in dict.fromkeys(places[0] for places in held.values()):
        after = render(texts[page], blocks)
        if after != texts[page]:
            changed.append(page)
            if not check:
                page.write_text(after)
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run folder with summary.json (default: the newest run)")
    parser.add_argument("--outputs", type=Path, default=ROOT / "outputs")
    parser.add_argument("--root", type=Path, default=ROOT, help="the folder whose README.md and docs/ hold the blocks")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a page differs")
    parser.add_argument("--vllm", type=Path, nargs="?", const=Path("outputs/figures_vllm"), default=None,
                        help="also run the evaluate probe on vLLM into this folder (default outputs/figures_vllm); "
                        "(about 2 minutes on 2 cores)")
    args = parser.parse_args()
    run = args.run or newest_run(args.outputs)
    summary = json.loads((run / "summary.json").read_text())
    changed = [o for o in summary.get("overrides", []) if not o.startswith(("paths.", "hydra."))]
    if changed:
        raise SystemExit(f"{run} ran with overrides {changed}: the README's figures are the defaults'")
    blocks = {"default-run": default_run_block(run, summary),
              "engines-agree": engines_block(summary, on_vllm(summary, args.vllm))}
    differ = [str(page.relative_to(args.root)) for page in write_blocks(blocks, args.root, check=args.check)]
    if args.check:
        print("figures match" if not differ else f"figures in {', '.join(differ)} differ from {run}")
        return int(bool(differ))
    print(f"{len(blocks)} figure blocks from {run}: " + (f"{', '.join(differ)} written" if differ else "unchanged"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
