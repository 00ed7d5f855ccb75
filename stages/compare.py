"""compare stage: how two draft vocab maps relate, in the numbers that explain a failed fine-tune.

In: maps A and B (vocab_map folders, SpecForge `.pt` files or drafter checkpoints).
Out: `compare.json` and `manifest.json`: target ids in both, only in A, only in B, draft positions that point at the
same target id, the first diverging position, and (when B was counted) the share of B's tokens A already covers.

    python -m stages.compare a=MAP_A b=MAP_B out=DIR
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig

from stages.common.contract.artifacts import staged_output
from stages.common.contract.stage import StageResult, stage_main
from stages.common.drafter.vocab import compare_vocab_maps, load_vocab_map


def run(cfg: DictConfig) -> StageResult:
    comparison = compare_vocab_maps(load_vocab_map(cfg.a), load_vocab_map(cfg.b))
    metrics = {k: v for k, v in asdict(comparison).items() if v is not None}
    out = Path(cfg.out) if cfg.out else Path(".")
    if cfg.out:
        with staged_output(cfg.out, "compare", cfg) as staged:
            report = {**asdict(comparison), "headline": comparison.headline(), "a": cfg.a, "b": cfg.b}
            (staged.path / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
            staged.update(metrics=metrics, headline=comparison.headline())
    return StageResult(out, metrics, comparison.headline())


if __name__ == "__main__":
    raise SystemExit(stage_main("compare", run))
