"""The pipeline's results for people: a terminal table, `summary.json`, and plots (PNG) of the story.

Phase 0 (the source drafter on the new target, as it is) against phase 1 (remapped and fine-tuned) and the
from-scratch baseline: accept_len, step-0 loss and accuracy, and the fine-tunes' per-step validation accuracy.
A sweep gets one table and one `summary.json` over all its members (`SweepSummary`, a Hydra callback).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from pipelines.runner import NodeResult
from stages.common.artifacts import write_json_atomic

def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def headline_numbers(results: dict[str, dict]) -> dict[str, Any]:
    """The numbers that tell the story, flat, for tables and the parent run."""
    def metric(node: str, key: str) -> Any:
        return results.get(node, {}).get("metrics", {}).get(key)

    numbers = {"phase0_accept_len": metric("probe", "accept_len"),
               "phase1_accept_len": metric("evaluate", "accept_len"),
               "baseline_accept_len": metric("baseline_evaluate", "accept_len"),
               "positions_agree": metric("compare", "positions_agree"),
               "shared_ids": metric("compare", "shared_ids")}
    for prefix, node in (("finetune", "finetune"), ("baseline", "baseline_finetune")):
        numbers[f"{prefix}_step0_loss"] = metric(node, "preflight_step0_loss")
        numbers[f"{prefix}_step0_acc"] = metric(node, "preflight_step0_acc")
        numbers[f"{prefix}_val_full_acc_0"] = metric(node, "val_full_acc_0")
    numbers["as_is_step0_loss"] = metric("finetune", "preflight_as_is_step0_loss")
    numbers["as_is_step0_acc"] = metric("finetune", "preflight_as_is_step0_acc")
    return {key: value for key, value in numbers.items() if value is not None}


def stage_table(results: dict[str, NodeResult]) -> Table:
    table = Table(title="regraft: stages")
    for column in ("stage", "phase", "cache", "seconds", "overhead", "result"):
        table.add_column(column, justify="right" if column in ("seconds", "overhead") else "left")
    for result in results.values():
        table.add_row(result.name, result.phase, "hit" if result.hit else "ran", f"{result.seconds:.1f}",
                      f"{result.overhead_seconds:.1f}", result.headline)
    return table


def story_table(numbers: dict[str, Any], title: str = "regraft: phase 0 vs phase 1") -> Table:
    table = Table(title=title)
    table.add_column("measure")
    table.add_column("value", justify="right")
    labels = {"phase0_accept_len": "accept_len, phase 0 (source drafter as it is)",
              "phase1_accept_len": "accept_len, phase 1 (remap + fine-tune)",
              "baseline_accept_len": "accept_len, from-scratch baseline",
              "shared_ids": "draft ids shared by the source and new maps",
              "positions_agree": "draft positions that point at the same token",
              "as_is_step0_loss": "step-0 loss, source lm_head as it is",
              "finetune_step0_loss": "step-0 loss, fine-tune init",
              "baseline_step0_loss": "step-0 loss, from scratch",
              "as_is_step0_acc": "step-0 accuracy, source lm_head as it is",
              "finetune_step0_acc": "step-0 accuracy, fine-tune init",
              "baseline_step0_acc": "step-0 accuracy, from scratch",
              "finetune_val_full_acc_0": "val accuracy (step 0) after fine-tune",
              "baseline_val_full_acc_0": "val accuracy (step 0) after scratch"}
    for key, label in labels.items():
        if key in numbers:
            table.add_row(label, fmt(numbers[key], 0 if key in ("shared_ids", "positions_agree") else 3))
    return table


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


def plot(results: dict[str, dict], run_dir: Path) -> list[Path]:
    """per_step_accuracy.png, loss_curves.png and accept_len.png in the run folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for node, label in (("finetune", "remap + fine-tune"), ("baseline_finetune", "from scratch")):
        accuracy = per_step_accuracy(results, node)
        if accuracy:
            axes.plot(range(len(accuracy)), accuracy, marker="o", label=label)
    axes.set(xlabel="TTT step", ylabel="val full accuracy", ylim=(0, 1), title="per-step accuracy")
    axes.legend()
    figure.tight_layout()
    figure.savefig(run_dir / "per_step_accuracy.png", dpi=100)
    written.append(run_dir / "per_step_accuracy.png")
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for node, label in (("finetune", "remap + fine-tune"), ("baseline_finetune", "from scratch")):
        if node in results:
            steps, losses = read_curve(results[node]["out"], "train", "loss")
            axes.plot(steps, losses, label=f"{label} (train)")
            steps, losses = read_curve(results[node]["out"], "val", "loss")
            axes.plot(steps, losses, marker="o", linestyle="--", label=f"{label} (val)")
    axes.set(xlabel="optimizer step", ylabel="weighted TTT loss", title="loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(run_dir / "loss_curves.png", dpi=100)
    written.append(run_dir / "loss_curves.png")
    plt.close(figure)

    bars = [(label, results[node]["metrics"]["accept_len"]) for node, label in
            (("probe", "phase 0\nas it is"), ("evaluate", "phase 1\nremap+ft"), ("baseline_evaluate", "scratch"))
            if node in results and "accept_len" in results[node]["metrics"]]
    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.bar([b[0] for b in bars], [b[1] for b in bars], color=["tab:gray", "tab:green", "tab:blue"][: len(bars)])
    axes.set(ylabel="accept_len", title="accept length")
    figure.tight_layout()
    figure.savefig(run_dir / "accept_len.png", dpi=100)
    written.append(run_dir / "accept_len.png")
    plt.close(figure)
    return written


def write_summary(run_dir: Path, results: dict[str, NodeResult], config: dict, overrides: list[str],
                  wall_seconds: float) -> dict:
    stages = {name: {**asdict(result), "overhead_seconds": round(result.overhead_seconds, 3)}
              for name, result in results.items()}
    summary = {"overrides": overrides, "wall_seconds": round(wall_seconds, 2), "numbers": headline_numbers(stages),
               "stages": stages, "config": config}
    write_json_atomic(run_dir / "summary.json", summary)
    return summary


class SweepSummary(Callback):
    """After `regraft -m ...`: one table and one summary.json over all sweep members."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        members = []
        for path in sorted(sweep_dir.glob("*/summary.json"), key=lambda p: int(p.parent.name)
                           if p.parent.name.isdigit() else 0):
            summary = json.loads(path.read_text())
            members.append({"member": path.parent.name, "overrides": summary["overrides"],
                            "numbers": summary["numbers"], "ran": [n for n, s in summary["stages"].items()
                                                                   if not s["hit"]]})
        if not members:
            return
        write_json_atomic(sweep_dir / "summary.json", {"members": members})
        keys = [k for k in ("phase0_accept_len", "phase1_accept_len", "baseline_accept_len", "finetune_step0_loss",
                            "finetune_val_full_acc_0") if any(k in m["numbers"] for m in members)]
        table = Table(title=f"regraft sweep: {len(members)} members")
        table.add_column("member")
        table.add_column("overrides")
        for key in keys:
            table.add_column(key, justify="right")
        table.add_column("stages run", justify="right")
        for member in members:
            table.add_row(member["member"], " ".join(member["overrides"]),
                          *[fmt(member["numbers"].get(key)) for key in keys], str(len(member["ran"])))
        console = Console()
        console.print(table)
        console.print(f"sweep summary: {sweep_dir / 'summary.json'}")
