"""The pipeline's results for people: a terminal table, `summary.json`, and plots (PNG) of the story.

Phase 0 (the source drafter on the new target, as it is) against phase 1 (remapped and fine-tuned) and the
from-scratch baseline: accept_len, step-0 loss and accuracy, and the fine-tunes' per-step validation accuracy.
A sweep gets one table and one `summary.json` over all its members (`SweepSummary`, a Hydra callback).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich import box
from rich.console import Console
from rich.table import Table

from pipelines.core.dag import BASELINE, COMPARE, DIAGNOSE, PHASE1, PROBE
from pipelines.core.runner import NodeResult
from stages.common.contract.artifacts import write_json_atomic
from stages.common.contract.errors import naming_full_disk

def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


# The parent run's figures: (name, the nodes it is read from (the first that has it), that node's figure, what it
# means). Each is a child's figure under its node's role and the child's own name for it (the fine-tune's
# `preflight/full_acc_0` is `phase1/full_acc_0`; its `as_is_` figures, the source as it is, are phase 0); every name
# differs from the others in its first 12 characters, which is what MLflow's runs table shows of a column's name at
# its width (tests/test_tracking.py holds this).
HEADLINES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("phase0/accept_len", (PROBE,), "accept_len", "accept_len, phase 0 (source as it is)"),
    ("phase1/accept_len", (PHASE1.evaluate,), "accept_len", "accept_len, phase 1 (fine-tuned)"),
    ("scratch/accept_len", (BASELINE.evaluate,), "accept_len", "accept_len, from-scratch baseline"),
    ("maps/shared_ids", (COMPARE,), "shared_ids", "draft ids shared by the two maps"),
    ("maps/positions_agree", (COMPARE,), "positions_agree", "draft positions at the same token"),
    # the guard's TTT step 0 on the first training batch; phase 0 is the source lm_head as it is
    ("phase0/loss_0", (PHASE1.train, BASELINE.train), "preflight_as_is_loss_0", "step-0 loss, source as it is"),
    ("phase1/loss_0", (PHASE1.train,), "preflight_loss_0", "step-0 loss, fine-tune init"),
    ("scratch/loss_0", (BASELINE.train,), "preflight_loss_0", "step-0 loss, from scratch"),
    ("phase0/full_acc_0", (PHASE1.train, BASELINE.train), "preflight_as_is_full_acc_0", "step-0 acc, source as it is"),
    ("phase1/full_acc_0", (PHASE1.train,), "preflight_full_acc_0", "step-0 acc, fine-tune init"),
    ("scratch/full_acc_0", (BASELINE.train,), "preflight_full_acc_0", "step-0 acc, from scratch"),
    ("phase1/val_acc_0", (PHASE1.train,), "val_full_acc_0", "val acc (TTT step 0) after fine-tune"),
    ("scratch/val_acc_0", (BASELINE.train,), "val_full_acc_0", "val acc (TTT step 0) after scratch"),
    ("diagnose/cka_mean", (DIAGNOSE,), "cka_mean", "CKA(old target, new), aux layers"),
    ("diagnose/transfer_gap", (DIAGNOSE,), "transfer_gap", "transfer gap: held-out step-0 loss"),
    ("diagnose/remap_loss_0", (DIAGNOSE,), "heldout_loss_0_remap", "held-out step-0 loss, remapped"),
    ("diagnose/realign_loss_0", (DIAGNOSE,), "heldout_loss_0_realign", "held-out step-0 loss, re-aligned"),
)
# Each accept_len headline's per-request mean (the probe's `accept_len_per_request`): beside the pooled figure in
# summary.json and the parent run, not in the story table, which keeps the pooled figures regraft decides by.
PER_REQUEST = {"phase0/accept_len": "phase0/request_mean", "phase1/accept_len": "phase1/request_mean",
               "scratch/accept_len": "scratch/request_mean"}
GAINS = (("gain/over_phase0", "phase0/accept_len", "accept_len gain of phase 1 over phase 0"),
         ("gain/over_scratch", "scratch/accept_len", "accept_len gain of phase 1 over scratch"))
RACE_LABELS = {"race/compute_share": "race: share of all-to-the-end compute",
               "race/steps_spent": "race: optimizer steps spent",
               "race/loss_transfer": "race: val loss, best transfer",
               "race/loss_scratch": "race: val loss, best scratch",
               "race/len_transfer": "race: accept_len, best transfer",
               "race/len_scratch": "race: accept_len, best scratch",
               "race/req_transfer": "race: accept_len per-request mean, best transfer",
               "race/req_scratch": "race: accept_len per-request mean, best scratch"}
COUNTS = ("maps/shared_ids", "maps/positions_agree")  # shown as integers


def one_computation(results: dict[str, dict]) -> list[list[str]]:
    """Nodes that are one computation (same stage, same cache key): with finetune.init=scratch the fine-tune is the
    baseline's, and its evaluation the baseline's evaluation."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, result in results.items():
        groups.setdefault((result["stage"], result["key"]), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def phase1_is_scratch(results: dict[str, dict]) -> bool:
    return any({PHASE1.train, BASELINE.train} <= set(group) for group in one_computation(results))


def headline_numbers(results: dict[str, dict]) -> dict[str, Any]:
    """The numbers that tell the story, for tables and the parent run, named as MLflow shows them (HEADLINES). When
    the fine-tune is the scratch baseline (one cache key) the `scratch/` figures are left out, not shown twice."""
    def metric(nodes: tuple[str, ...], key: str) -> Any:
        return next((value for node in nodes if (value := results.get(node, {}).get("metrics", {}).get(key))
                     is not None), None)

    numbers = {name: metric(nodes, key) for name, nodes, key, _ in HEADLINES}
    numbers.update({PER_REQUEST[name]: metric(nodes, "accept_len_per_request") for name, nodes, _, _ in HEADLINES
                    if name in PER_REQUEST})
    numbers.update(per_eval_set(results))
    phase1 = numbers["phase1/accept_len"]
    for name, other, _ in GAINS:
        if phase1 is not None and numbers[other] is not None:
            numbers[name] = phase1 - numbers[other]
    if phase1_is_scratch(results):
        numbers = {key: value for key, value in numbers.items() if not key.startswith("scratch/")
                   and key != "gain/over_scratch"}
    return {key: value for key, value in numbers.items() if value is not None}


def per_eval_set(results: dict[str, dict]) -> dict[str, float]:
    """Each accept_len headline per eval set, `phase1/accept_len/<set>`, from its node's `accept_len/<set>`."""
    numbers: dict[str, float] = {}
    for name, nodes, key, _ in HEADLINES:
        if key != "accept_len":
            continue
        node = next((node for node in nodes if node in results), None)
        for figure, value in (results[node].get("metrics", {}) if node else {}).items():
            if figure.startswith("accept_len/") and value is not None:
                numbers[f"{name}/{figure.removeprefix('accept_len/')}"] = value
    return numbers


def stage_table(results: dict[str, NodeResult]) -> FittedTable:
    """One line per stage at any width (80 columns and up): the result is cut with an ellipsis where it does not
    fit (each stage's whole result was printed when it finished)."""
    rows = []
    first: dict[tuple[str, str], str] = {}
    for result in results.values():
        same = first.setdefault((result.stage, result.key), result.name)
        shown = result.headline if same == result.name else f"same computation as {same} (one cache key)"
        rows.append((result.name, result.phase, "hit" if result.hit else "ran", f"{result.seconds:.1f}",
                     f"{result.overhead_seconds:.1f}", shown))
    return fitted_table("regraft: stages", ("stage", "phase", "cache", "s", "job s", "result"), rows,
                        right=("s", "job s"))


class FittedTable:
    """A table whose columns are as wide as their widest cell, except the last, which takes what the terminal has
    left and ends in an ellipsis where that is not enough: one line per row at any width, never a wrapped cell."""

    def __init__(self, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[str, ...] = (),
                 caption: str | None = None, dim_last: bool = False):
        self.title, self.columns, self.rows, self.right = title, columns, rows, right
        self.caption, self.dim_last = caption, dim_last

    def table(self, width: int) -> Table:
        widths = [max([len(column), *(len(str(row[i])) for row in self.rows)]) for i, column in enumerate(self.columns)]
        used = sum(widths[:-1]) + 3 * (len(widths) - 1)  # a cell's padding and the column separator
        widths[-1] = max(min(widths[-1], width - used), min(len(self.columns[-1]), 8))
        table = Table(title=self.title, caption=self.caption, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for index, (column, column_width) in enumerate(zip(self.columns, widths)):
            last = index == len(self.columns) - 1
            table.add_column(column, width=column_width, no_wrap=True, overflow="ellipsis",
                             justify="right" if column in self.right else "left",
                             style="dim" if last and self.dim_last else None)
        for row in self.rows:
            table.add_row(*row)
        return table

    def __rich_console__(self, console: Console, options: Any) -> Any:
        yield self.table(options.max_width)


def fitted_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[str, ...] = (),
                 caption: str | None = None, dim_last: bool = False) -> FittedTable:
    return FittedTable(title, columns, rows, right, caption, dim_last)


LABELS = {**{name: label for name, _, _, label in HEADLINES}, **{name: label for name, _, label in GAINS},
          **RACE_LABELS}


def story_table(numbers: dict[str, Any], title: str = "regraft: phase 0 vs phase 1", caption: str | None = None
                ) -> FittedTable:
    """The story, each figure beside its name in the parent MLflow run."""
    return fitted_table(title, ("measure", "value", "MLflow"), story_rows(numbers), right=("value",), caption=caption,
                        dim_last=True)


def story_rows(numbers: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(what it means, value, MLflow name) of every headline there is, each figure per eval set under its
    aggregate."""
    rows = []
    for key, label in LABELS.items():
        if key in numbers:
            rows.append((label, fmt(numbers[key], 0 if key in COUNTS else 3), key))
        rows += [(f"  on {figure.removeprefix(key + '/')}", fmt(value, 3), figure) for figure, value in numbers.items()
                 if figure.startswith(key + "/")]
    return rows


def story_caption(summary: dict) -> str | None:
    """Said under the story table: when phase 1 and the baseline are one computation, and when the per-request
    mean ranks the phases unlike the pooled accept_len."""
    said = [line for line in (accept_len_orders(summary.get("numbers", {})),) if line]
    if summary.get("phase1_is_scratch"):
        said.insert(0, "finetune.init=scratch: the fine-tune is the from-scratch baseline (one cache key), so phase 1 "
                       "is the scratch result; it is not shown twice")
    return "\n".join(said) or None


def accept_len_orders(numbers: dict[str, Any]) -> str | None:
    """A line when the per-request mean of accept_len ranks phase 0, phase 1 and scratch in another order than the
    pooled figure does (the figures shown are pooled; a benchmark averaging per request would rank them so)."""
    phases = [name.split("/")[0] for name in PER_REQUEST if name in numbers and PER_REQUEST[name] in numbers]
    if len(phases) < 2:
        return None
    pooled = sorted(phases, key=lambda phase: -numbers[f"{phase}/accept_len"])
    per_request = sorted(phases, key=lambda phase: -numbers[f"{phase}/request_mean"])
    if pooled == per_request:
        return None
    return (f"accept_len pooled over all turns ranks {' > '.join(pooled)}; its per-request mean ranks "
            f"{' > '.join(per_request)} (" + ", ".join(f"{phase} {numbers[f'{phase}/request_mean']:.3f}"
                                                      for phase in per_request) + ")")


def per_step_accuracy(results: dict[str, dict], node: str) -> list[float]:
    metrics = results.get(node, {}).get("metrics", {})
    steps = sorted(int(key.rsplit("_", 1)[1]) for key in metrics if key.startswith("val_full_acc_"))
    return [metrics[f"val_full_acc_{step}"] for step in steps]


def read_curve(out: str, split: str, key: str) -> tuple[list[int], list[float]]:
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return [], []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    points = [(r["step"], r[key]) for r in records if r.get("split") == split and key in r]
    return [p[0] for p in points], [p[1] for p in points]


PLOTS = ("per_step_accuracy.png", "loss_curves.png", "accept_len.png")
PLOTTED = (PHASE1.train, BASELINE.train, PROBE, PHASE1.evaluate, BASELINE.evaluate)  # the nodes the plots read


def plots_key(results: dict[str, dict]) -> str:
    """What the plots show, as a content address: the cache keys of the outputs they read (an output's key fixes
    its metrics and curves) and this module, which draws them."""
    read = {node: results[node]["key"] for node in PLOTTED if node in results}
    payload = json.dumps(read, sort_keys=True).encode() + Path(__file__).read_bytes()
    return hashlib.sha256(payload).hexdigest()[:16]


def plot(results: dict[str, dict], run_dir: Path, cache: Path | None = None) -> list[Path]:
    """per_step_accuracy.png, loss_curves.png and accept_len.png in the run folder. With `cache` (paths.cache),
    the plots of the same outputs are drawn once, kept under cache/plots/, and copied into each later run's folder:
    a warm rerun draws nothing."""
    if cache is None:
        return draw_plots(results, run_dir)
    from filelock import FileLock

    kept = cache / "plots" / plots_key(results)
    kept.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(kept) + ".lock"):
        if not all((kept / name).is_file() for name in PLOTS):
            drawn = kept.with_name(f".{kept.name}.tmp-{uuid.uuid4().hex[:8]}")
            draw_plots(results, drawn)
            shutil.rmtree(kept, ignore_errors=True)
            os.replace(drawn, kept)
        for name in PLOTS:
            with naming_full_disk(run_dir / name):
                shutil.copyfile(kept / name, run_dir / f".{name}.tmp")
                os.replace(run_dir / f".{name}.tmp", run_dir / name)
    return [run_dir / name for name in PLOTS]


def draw_plots(results: dict[str, dict], run_dir: Path) -> list[Path]:
    """The three plots drawn into `run_dir`."""
    import matplotlib

    run_dir.mkdir(parents=True, exist_ok=True)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for node, label in ((run.train, run.label) for run in (PHASE1, BASELINE)):
        accuracy = per_step_accuracy(results, node)
        if accuracy:
            axes.plot(range(len(accuracy)), accuracy, marker="o", label=label)
    axes.set(xlabel="TTT step", ylabel="val full accuracy", ylim=(0, 1), title="per-step accuracy")
    axes.legend()
    figure.tight_layout()
    written.append(save_figure(figure, run_dir / "per_step_accuracy.png"))
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for node, label in ((run.train, run.label) for run in (PHASE1, BASELINE)):
        if node in results:
            steps, losses = read_curve(results[node]["out"], "train", "loss")
            axes.plot(steps, losses, label=f"{label} (train)")
            steps, losses = read_curve(results[node]["out"], "val", "loss")
            axes.plot(steps, losses, marker="o", linestyle="--", label=f"{label} (val)")
    axes.set(xlabel="optimizer step", ylabel="weighted TTT loss", title="loss")
    axes.legend()
    figure.tight_layout()
    written.append(save_figure(figure, run_dir / "loss_curves.png"))
    plt.close(figure)

    bars = [(label, results[node]["metrics"]["accept_len"]) for node, label in
            ((PROBE, "phase 0\nas it is"), (PHASE1.evaluate, "phase 1\nremap+ft"), (BASELINE.evaluate, "scratch"))
            if node in results and "accept_len" in results[node]["metrics"]]
    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.bar([b[0] for b in bars], [b[1] for b in bars], color=["tab:gray", "tab:green", "tab:blue"][: len(bars)])
    axes.set(ylabel="accept_len", title="accept length")
    figure.tight_layout()
    written.append(save_figure(figure, run_dir / "accept_len.png"))
    plt.close(figure)
    return written


def save_figure(figure: Any, path: Path) -> Path:
    """The figure as a PNG at `path`, whole or not at all: written beside it, then renamed (a full disk leaves no
    cut-off image, and raises the full-disk line naming it)."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with naming_full_disk(path):
            figure.savefig(tmp, dpi=100, format="png")
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_summary(run_dir: Path, results: dict[str, NodeResult], config: dict, overrides: list[str],
                  wall_seconds: float, race: dict | None = None, failed: str | None = None) -> dict:
    stages = {name: {**asdict(result), "overhead_seconds": round(result.overhead_seconds, 3)}
              for name, result in results.items()}
    summary = {"overrides": overrides, "wall_seconds": round(wall_seconds, 2), "numbers": headline_numbers(stages),
               "one_computation": one_computation(stages), "phase1_is_scratch": phase1_is_scratch(stages),
               "stages": stages, "config": config}
    if race is not None:  # pipeline.race: the decision and its rung table; phase 1 is the winner's evaluate
        summary["race"] = race
        summary["numbers"].update({"race/compute_share": race["compute_share"],
                                   "race/steps_spent": race["steps_spent"]})
        for finalist in race["finalists"]:  # transfer or scratch, at the full budget: one figure per family
            summary["numbers"][f"race/loss_{finalist['family']}"] = finalist["val_loss"]
            if finalist["accept_len"] is not None:
                summary["numbers"][f"race/len_{finalist['family']}"] = finalist["accept_len"]
            if finalist.get("accept_len_per_request") is not None:
                summary["numbers"][f"race/req_{finalist['family']}"] = finalist["accept_len_per_request"]
            for name, value in finalist.get("per_set", {}).items():
                summary["numbers"][f"race/len_{finalist['family']}/{name}"] = value
    if failed:  # a sweep member whose stage failed: `<node>: <its line>`
        summary["failed"] = failed
    with naming_full_disk(run_dir / "summary.json"):
        write_json_atomic(run_dir / "summary.json", summary)
    return summary


def finish_run(run_dir: Path, results: dict[str, NodeResult], cfg: DictConfig, overrides: list[str],
               wall_seconds: float, tracker, race: dict | None = None, failed: str | None = None
               ) -> tuple[dict, list[Path]]:
    """A run's (or sweep member's) end: summary.json, its plots unless it failed, its MLflow parent run closed."""
    summary = write_summary(run_dir, results, OmegaConf.to_container(cfg, resolve=True), overrides, wall_seconds,
                            race=race, failed=failed)
    plots = [] if failed else plot(summary["stages"], run_dir, Path(cfg.paths.cache))
    write_log(run_dir / "regraft.log", results, summary)
    if tracker is not None:
        tracker.finish_pipeline("FAILED" if failed else "FINISHED", overrides, summary,
                                [run_dir / "summary.json", *plots])
    return summary, plots


def write_log(path: Path, results: dict[str, NodeResult], summary: dict) -> None:
    """The run's tables, as the terminal shows them, appended to its log (a sweep member prints none of its own)."""
    with naming_full_disk(path), path.open("a") as handle:
        console = Console(file=handle, width=120, no_color=True)
        console.print(stage_table(results))
        console.print(story_table(summary["numbers"], caption=story_caption(summary)))
        if summary.get("failed"):
            console.print(f"failed: {summary['failed']}", highlight=False, soft_wrap=True)


SWEEP_COLUMNS = (("phase0/accept_len", "phase 0"), ("phase1/accept_len", "phase 1"),
                 ("scratch/accept_len", "scratch"), ("phase1/val_acc_0", "val acc0"))


def varying(members: list[dict], swept: list[str]) -> list[str]:
    """The keys a sweep varies: those given with several values, else those whose values differ among members."""
    from pipelines.tracking.run_names import override_key

    given = [{override_key(o): o.split("=", 1)[-1] for o in member["overrides"]} for member in members]
    keys = [key for key in swept if any(key in overrides for overrides in given)]
    if keys:
        return keys
    every = list(dict.fromkeys(key for overrides in given for key in overrides))
    return [key for key in every if len({overrides.get(key) for overrides in given}) > 1]


class SweepSummary(Callback):
    """After `regraft -m ...`: one table and one summary.json over all sweep members, showing only the overrides the
    sweep varies (80 columns)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from pipelines.tracking.run_names import override_key, short_keys, swept_keys

        sweep_dir = Path(config.hydra.sweep.dir)
        members = []
        for path in sorted(sweep_dir.glob("*/summary.json"), key=lambda p: int(p.parent.name)
                           if p.parent.name.isdigit() else 0):
            summary = json.loads(path.read_text())
            members.append({"member": path.parent.name, "overrides": summary["overrides"],
                            "numbers": summary["numbers"], "phase1_is_scratch": summary.get("phase1_is_scratch", False),
                            "ran": [n for n, s in summary["stages"].items() if not s["hit"]],
                            "failed": summary.get("failed")})
        if not members:
            return
        params = config.hydra.sweeper.get("params")
        keys = varying(members, swept_keys(list(config.hydra.overrides.task),
                                           OmegaConf.to_container(params) if params else None))
        for member in members:
            values = {override_key(o): o.split("=", 1)[-1] for o in member["overrides"]}
            member["varies"] = {key: values.get(key, "") for key in keys}
        with naming_full_disk(sweep_dir / "summary.json"):
            write_json_atomic(sweep_dir / "summary.json", {"swept": keys, "members": members})
        columns = [(key, label) for key, label in SWEEP_COLUMNS if any(key in m["numbers"] for m in members)]
        table = Table(title=f"regraft sweep: {len(members)} members", box=box.SIMPLE_HEAD, pad_edge=False,
                      caption="=phase 1: finetune.init=scratch, so the fine-tune is the scratch baseline"
                      if any(m["phase1_is_scratch"] for m in members) else None)
        table.add_column("#", justify="right", no_wrap=True)
        short = short_keys(keys)
        for key in keys:
            table.add_column(short[key], no_wrap=True, overflow="ellipsis")
        for _, label in columns:
            table.add_column(label, justify="right", no_wrap=True)
        table.add_column("ran", justify="right", no_wrap=True)
        for member in members:
            shown = ["=phase 1" if member["phase1_is_scratch"] and key.startswith("scratch/")
                     else fmt(member["numbers"].get(key)) for key, _ in columns]
            table.add_row(member["member"], *member["varies"].values(), *shown,
                          "failed" if member["failed"] else str(len(member["ran"])))
        console = Console()
        console.print(table)
        for member in members:  # one line each: which stage, and its own error line
            if member["failed"]:
                varies = " ".join(f"{short[k]}={v}" for k, v in member["varies"].items())
                console.print(f"[red]member {member['member']}[/red] ({varies}) failed at {member['failed']}",
                              highlight=False, soft_wrap=True)
        console.print(f"sweep summary: {sweep_dir / 'summary.json'}", highlight=False, soft_wrap=True)
        if config.tracking.enabled:
            from pipelines.tracking.tracker import sweep_link, ui_command

            console.print(f"MLflow: {ui_command(config.tracking)}", highlight=False, soft_wrap=True)
            link = sweep_link(config.tracking, sweep_dir.name)
            if link:
                console.print(f"which member won: {link}", highlight=False, soft_wrap=True)
        if any(member["failed"] for member in members):
            raise SystemExit(1)  # the others finished; the sweep as a whole did not
