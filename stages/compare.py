"""compare stage: how two draft vocab maps relate, in the numbers that explain a failed fine-tune.

In: maps A and B (vocab_map folders, SpecForge `.pt` files or drafter checkpoints).
Out: `compare.json` and `manifest.json`: target ids in both, only in A, only in B, draft positions that point at the
same target id, the first diverging position, and (when B was counted) the share of B's tokens A already covers.

    python -m stages.compare a=MAP_A b=MAP_B out=DIR
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf import MISSING, DictConfig

from stages.common.artifacts import staged_output
from stages.common.cli import StageResult, register_schema, stage_main
from stages.common.vocab import VocabMap, load_vocab_map


@dataclass
class CompareConfig:
    a: str = MISSING  # e.g. the source drafter (its own map)
    b: str = MISSING  # e.g. the map built for the new target
    out: Optional[str] = None  # where to write compare.json; None: print only


register_schema("compare", CompareConfig)


@dataclass(frozen=True)
class MapComparison:
    size_a: int
    size_b: int
    shared_ids: int
    only_in_a: int
    only_in_b: int
    positions_agree: int  # draft positions p where both maps name the same target id
    first_divergence: int | None  # the lowest such p where they differ; None when they never do
    b_tokens_covered_by_shared: float | None  # share of B's counted tokens whose id A also has

    @property
    def aligned(self) -> bool:
        return self.size_a == self.size_b and self.positions_agree == self.size_a

    def headline(self) -> str:
        return (f"{self.positions_agree} of {self.size_b} draft positions agree; "
                f"{self.shared_ids} target ids shared ({self.only_in_a} only in A, {self.only_in_b} only in B)")


def compare_vocab_maps(a: VocabMap, b: VocabMap) -> MapComparison:
    ids_a, ids_b = a.target_ids, b.target_ids
    shared = torch.isin(ids_b, ids_a)
    overlap = min(ids_a.numel(), ids_b.numel())
    differs = torch.nonzero(ids_a[:overlap] != ids_b[:overlap]).flatten()
    first = int(differs[0]) if differs.numel() else (overlap if ids_a.numel() != ids_b.numel() else None)
    covered = None
    if b.token_counts is not None and int(b.token_counts.sum()) > 0:
        covered = float(b.token_counts[ids_b[shared]].sum()) / float(b.token_counts.sum())
    return MapComparison(
        size_a=ids_a.numel(), size_b=ids_b.numel(), shared_ids=int(shared.sum()),
        only_in_a=int((~torch.isin(ids_a, ids_b)).sum()), only_in_b=int((~shared).sum()),
        positions_agree=overlap - differs.numel(), first_divergence=first, b_tokens_covered_by_shared=covered)


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
