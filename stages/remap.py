"""remap stage: re-point a pretrained drafter's lm_head rows from its own draft vocab to a new one.

In: a source drafter (either layout, carrying its own `d2t`), a destination vocab map, and the verifier (the target
model folder, whose lm_head rows are read for the destination ids only).
Out: a drafter folder in the chosen layout whose `d2t`/`t2d` are the destination's, `report.json`, `manifest.json`.

Destination row p takes the source row of the same target id when the source draft vocab has it; every other row
comes from `fallback`: the verifier's lm_head row of that id (`verifier`), a fresh init (`random`) or the mean
source row (`mean`). All other weights are carried over unchanged. Tensors stream from file to file, so a
Kimi-sized drafter is never held in memory.

    python -m stages.remap drafter=SRC vocab_map=MAP verifier=TARGET_DIR out=DIR
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from omegaconf import DictConfig

from stages.common.contract.artifacts import staged_output
from stages.common.drafter.checkpoint import DrafterCheckpoint, write_drafter
from stages.common.contract.stage import StageResult, stage_main
from stages.common.contract.errors import RegraftError
from stages.common.drafter.tensor_io import ROWS_PER_CHUNK, TensorSpec, spec_of
from stages.common.drafter.verifier import Verifier
from stages.common.drafter.vocab import RemapPlan, VocabMap, compare_vocab_maps, load_vocab_map
from stages.schemas.remap import Fallback, OutputLayout



@dataclass(frozen=True)
class RemapCounts:
    rows_remapped: int
    rows_from_fallback: int
    source_rows_dropped: int


def mean_row_norm(chunks: Iterator[torch.Tensor]) -> float:
    total, rows = 0.0, 0
    for chunk in chunks:
        total += float(chunk.float().norm(dim=1).sum())
        rows += chunk.shape[0]
    return total / max(rows, 1)


RowReader = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, buffer to fill if it can) -> rows


def verifier_rows(verifier: Verifier, dtype: torch.dtype) -> RowReader:
    """Read verifier rows straight into the buffer when dtypes agree, else read and convert."""
    if verifier.lm_head_dtype == dtype:
        return lambda ids, out: verifier.lm_head_rows(ids, out)
    return lambda ids, out: verifier.lm_head_rows(ids).to(dtype)


class FallbackRows:
    """Produces the rows of destination positions the source vocab lacks, in order of position."""

    def __init__(self, cfg: DictConfig, source: DrafterCheckpoint, plan: RemapPlan, verifier: Verifier | None):
        self.kind = Fallback(cfg.fallback)
        self.dtype = source.dtype("lm_head.weight")
        self.hidden = source.config.hidden_size
        self.scale = 1.0
        self.generator = torch.Generator().manual_seed(int(cfg.seed))
        self.bound = 1.0 / math.sqrt(self.hidden)  # nn.Linear's default init, as a fresh drafter gets
        if self.kind is Fallback.verifier:
            if verifier is None:
                raise RegraftError(cfg.drafter, "fallback=verifier needs the target model",
                                   "pass verifier=TARGET_DIR, or choose fallback=random|mean")
            if verifier.hidden_size != self.hidden:
                raise RegraftError(verifier.path, f"target hidden {verifier.hidden_size} != drafter hidden "
                                   f"{self.hidden}, so its lm_head rows do not fit",
                                   "choose fallback=random or fallback=mean")
            self.read_verifier = verifier_rows(verifier, self.dtype)
            if cfg.match_source_scale and plan.from_fallback:
                missing = plan.dest_ids[plan.source_rows < 0]
                verifier_norm = mean_row_norm(iter([verifier.lm_head_rows(missing)]))
                self.scale = mean_row_norm(source.row_chunks("lm_head.weight")) / max(verifier_norm, 1e-12)
        if self.kind is Fallback.mean:
            total = torch.zeros(self.hidden, dtype=torch.float64)
            for chunk in source.row_chunks("lm_head.weight"):
                total += chunk.double().sum(0)
            self.mean_row = (total / source.config.draft_vocab_size).to(self.dtype)

    def rows(self, target_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.kind is Fallback.verifier:
            rows = self.read_verifier(target_ids, out)
            return rows if self.scale == 1.0 else (rows.float() * self.scale).to(self.dtype)
        if self.kind is Fallback.mean:
            return self.mean_row.expand(target_ids.numel(), -1)
        shape = (target_ids.numel(), self.hidden)
        return (torch.rand(shape, generator=self.generator) * 2 - 1).mul_(self.bound).to(self.dtype)


def remapped_rows_spec(name: str, plan: RemapPlan, read_source: RowReader, read_fallback: RowReader,
                       dtype: torch.dtype, width: int) -> TensorSpec:
    """Stream a [N_dst, width] tensor chunk by chunk: source rows where the plan has them, fallback rows elsewhere.

    Two buffers are reused for every chunk (the writer consumes a chunk before asking for the next), so memory
    stays at two chunks whatever the vocab size.
    """

    def chunks() -> Iterator[torch.Tensor]:
        chunk = torch.empty((ROWS_PER_CHUNK, width), dtype=dtype)
        staging = torch.empty((ROWS_PER_CHUNK, width), dtype=dtype)
        for start in range(0, plan.source_rows.numel(), ROWS_PER_CHUNK):
            rows = plan.source_rows[start:start + ROWS_PER_CHUNK]
            ids = plan.dest_ids[start:start + ROWS_PER_CHUNK]
            view = chunk[: rows.numel()]
            have, lack = torch.nonzero(rows >= 0).flatten(), torch.nonzero(rows < 0).flatten()
            if have.numel():
                view.index_copy_(0, have, read_source(rows[have], staging[: have.numel()]).to(dtype))
            if lack.numel():
                view.index_copy_(0, lack, read_fallback(ids[lack], staging[: lack.numel()]).to(dtype))
            yield view

    return TensorSpec(name, dtype, (plan.source_rows.numel(), width), chunks)


def plan_tensors(cfg: DictConfig, source: DrafterCheckpoint, dest: VocabMap, plan: RemapPlan,
                 verifier: Verifier | None) -> dict[str, TensorSpec]:
    fallback = FallbackRows(cfg, source, plan, verifier)
    tensors = {name: source.spec(name) for name in source.names()}
    tensors["lm_head.weight"] = remapped_rows_spec(
        "lm_head.weight", plan, lambda rows, out: source.gather_rows("lm_head.weight", rows, out), fallback.rows,
        source.dtype("lm_head.weight"), source.config.hidden_size)
    if "verifier_lm_head.weight" in source:  # speculators keeps the verifier's rows of the draft vocab too
        if verifier is None:
            raise RegraftError(cfg.drafter, "carries verifier_lm_head, which must be rebuilt for the new vocab",
                               "pass verifier=TARGET_DIR")
        every_row_from_verifier = RemapPlan(torch.full_like(plan.dest_ids, -1), plan.dest_ids)
        dtype = source.dtype("verifier_lm_head.weight")
        read = verifier_rows(verifier, dtype)
        tensors["verifier_lm_head.weight"] = remapped_rows_spec(
            "verifier_lm_head.weight", every_row_from_verifier, read, read, dtype,
            source.shape("verifier_lm_head.weight")[1])
    tensors["d2t"] = spec_of("d2t", dest.d2t)
    tensors["t2d"] = spec_of("t2d", dest.t2d)
    return tensors


def check_compatible(cfg: DictConfig, source: DrafterCheckpoint, dest: VocabMap, verifier: Verifier | None) -> None:
    if verifier is not None and verifier.vocab_size != dest.vocab_size:
        raise RegraftError(cfg.vocab_map, f"map is for a vocab of {dest.vocab_size} ids, the verifier has "
                           f"{verifier.vocab_size}", "build the map with the new target's tokenizer")
    if dest.vocab_size != source.config.vocab_size and "embed_tokens.weight" in source:
        raise RegraftError(cfg.drafter, "carries embed_tokens for a different vocab size than the new map",
                           "drop embed_tokens from the source (engines take it from the target)")


def run(cfg: DictConfig) -> StageResult:
    source = DrafterCheckpoint.open(cfg.drafter)
    dest = load_vocab_map(cfg.vocab_map)
    verifier = Verifier.open(cfg.verifier) if cfg.verifier else None
    check_compatible(cfg, source, dest, verifier)
    source_map = source.vocab_map()
    plan = RemapPlan.between(source_map, dest)
    counts = RemapCounts(rows_remapped=plan.remapped, rows_from_fallback=plan.from_fallback,
                         source_rows_dropped=source_map.draft_vocab_size - plan.remapped)
    comparison = compare_vocab_maps(source_map, dest)
    layout = source.layout if cfg.layout == OutputLayout.source else OutputLayout(cfg.layout).value
    layer = {**source.config.layer, "vocab_size": dest.vocab_size}
    config = replace(source.config, layer=layer, draft_vocab_size=dest.draft_vocab_size)
    if cfg.verifier:
        config = config.with_verifier(cfg.verifier, cfg.verifier_name)
    tensors = plan_tensors(cfg, source, dest, plan, verifier)
    metrics = {**asdict(counts), "positions_agree_before": comparison.positions_agree,
               "shared_ids": comparison.shared_ids}
    with staged_output(cfg.out, "remap", cfg) as staged:
        write_drafter(staged.path, config, tensors, layout)
        report = {"counts": asdict(counts), "comparison": asdict(comparison), "headline": comparison.headline(),
                  "fallback": Fallback(cfg.fallback).value, "layout": layout, "source_layout": source.layout,
                  "aux_convention": config.aux_convention, "family": config.describe()}
        (staged.path / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        staged.update(metrics=metrics, report=report, inputs={
            "drafter": str(Path(cfg.drafter).absolute()), "vocab_map": str(Path(cfg.vocab_map).absolute()),
            "verifier": cfg.verifier and str(Path(cfg.verifier).absolute())})
    headline = (f"{config.describe()}: {counts.rows_remapped} rows remapped, {counts.rows_from_fallback} from {Fallback(cfg.fallback).value}, "
                f"{counts.source_rows_dropped} source rows dropped")
    return StageResult(Path(cfg.out), metrics, headline)


if __name__ == "__main__":
    raise SystemExit(stage_main("remap", run))
