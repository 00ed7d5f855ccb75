"""The draft vocabulary map, as real checkpoints hold it, and what the stages do with two of them.

`d2t[p] = target_id[p] - p` (int64 [N]) and `t2d` (bool [V], True for ids in the draft vocab); the target id of
draft position p is `d2t[p] + p`. Here: building a map from token counts (vocab_map), comparing two maps
(compare, the finetune guard), planning where each lm_head row of one map goes in another (remap, the guard), and
reading a map from wherever one is kept: a vocab_map stage folder, a SpecForge `.pt` file (`{"d2t", "t2d"}`), a
safetensors file or a drafter checkpoint folder (its own map).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common.contract.errors import RegraftError
from stages.common.drafter.tensor_io import SafetensorsFiles

VOCAB_MAP_FILE = "vocab_map.safetensors"


@dataclass(frozen=True)
class VocabMap:
    d2t: torch.Tensor  # int64 [N]
    t2d: torch.Tensor  # bool [V]
    token_counts: torch.Tensor | None = None  # int64 [V], when the map was built from data
    source: str = "<memory>"

    @classmethod
    def from_target_ids(cls, target_ids: torch.Tensor, vocab_size: int, **kwargs) -> "VocabMap":
        target_ids = target_ids.to(torch.int64)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        d2t = target_ids - torch.arange(target_ids.numel(), dtype=torch.int64)
        return cls(d2t=d2t, t2d=t2d, **kwargs)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())

    @property
    def target_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel(), dtype=torch.int64)

    def validate(self) -> "VocabMap":
        """Raise RegraftError naming the source when d2t/t2d are not a consistent draft vocab map."""
        where = self.source
        if self.d2t.dtype != torch.int64 or self.d2t.dim() != 1:
            raise RegraftError(where, f"d2t must be int64 [N], got {self.d2t.dtype} {list(self.d2t.shape)}",
                               "rebuild the map with the vocab_map stage")
        if self.t2d.dtype != torch.bool or self.t2d.dim() != 1:
            raise RegraftError(where, f"t2d must be bool [V], got {self.t2d.dtype} {list(self.t2d.shape)}",
                               "rebuild the map with the vocab_map stage")
        ids = self.target_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise RegraftError(where, f"d2t + arange points outside the target vocab [0, {self.vocab_size}) "
                               f"(min {int(ids.min())}, max {int(ids.max())})",
                               "the map was built for another target vocab size; rebuild it")
        if torch.unique(ids).numel() != ids.numel():
            raise RegraftError(where, "d2t maps two draft positions to the same target id",
                               "a sorted map must be strictly increasing; rebuild it with the vocab_map stage")
        t2d_count = int(self.t2d.sum())
        if t2d_count != self.draft_vocab_size or not bool(self.t2d[ids].all()):
            raise RegraftError(where, f"t2d marks {t2d_count} ids but d2t has {self.draft_vocab_size} positions "
                               "(or they name different ids)", "d2t and t2d must come from the same map")
        return self


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int, source: str = "<counts>") -> VocabMap:
    """Top-N ids by count, sorted ascending. A stable sort breaks count ties by lower id and pads with unseen low
    ids (speculators' rule; SpecForge breaks ties by first appearance in its shuffled data, which no rerun can
    reproduce, so regraft takes the rule that depends on the counts alone)."""
    if draft_vocab_size > counts.numel():
        raise RegraftError(source, f"draft_vocab_size {draft_vocab_size} exceeds the target vocab {counts.numel()}",
                           "choose a smaller draft_vocab_size")
    chosen = torch.sort(counts, descending=True, stable=True).indices[:draft_vocab_size]
    return VocabMap.from_target_ids(chosen.sort().values, counts.numel(), token_counts=counts, source=source)


# ---------------------------------------------------------------- two maps


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


@dataclass(frozen=True)
class RemapPlan:
    """Where each destination row comes from: a source draft position, or -1 for the fallback."""

    source_rows: torch.Tensor  # int64 [N_dst]
    dest_ids: torch.Tensor  # int64 [N_dst], target ids of the destination positions

    @classmethod
    def between(cls, source: VocabMap, dest: VocabMap) -> "RemapPlan":
        size = max(source.vocab_size, dest.vocab_size)
        position_of = torch.full((size,), -1, dtype=torch.int64)
        position_of[source.target_ids] = torch.arange(source.draft_vocab_size)
        return cls(position_of[dest.target_ids], dest.target_ids)

    @property
    def remapped(self) -> int:
        return int((self.source_rows >= 0).sum())

    @property
    def from_fallback(self) -> int:
        return self.source_rows.numel() - self.remapped


# ---------------------------------------------------------------- reading a map


def _load_tensor_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".pt":
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise RegraftError(path, f"cannot read as a torch file ({exc})",
                               "pass a SpecForge vocab mapping saved with torch.save({'d2t', 't2d'})") from exc
        if not isinstance(payload, dict):
            raise RegraftError(path, "holds no dict", "save it as torch.save({'d2t': ..., 't2d': ...})")
        return payload
    files = SafetensorsFiles.open_file(path)
    return {name: files.get(name) for name in ("d2t", "t2d", "token_counts") if name in files}


def _drafter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """d2t and t2d of a drafter checkpoint folder (either layout; a `model.` prefix allowed), read alone."""
    files = SafetensorsFiles.open_model_dir(folder)
    stored = {name.removeprefix("model."): name for name in files.names()}
    return {name: files.get(stored[name]) for name in ("d2t", "t2d") if name in stored}


def load_vocab_map(path: str | Path) -> VocabMap:
    """Read a map from a vocab_map folder, a `.pt`/`.safetensors` file, or a drafter checkpoint folder."""
    path = Path(path)
    if not path.exists():
        raise RegraftError(path, "vocab map not found",
                           "give a vocab_map stage folder, a SpecForge .pt file or a drafter checkpoint folder")
    if path.is_dir() and (path / VOCAB_MAP_FILE).exists():
        path = path / VOCAB_MAP_FILE
    if path.is_dir():
        if not (path / "config.json").exists():
            raise RegraftError(path, f"folder has neither {VOCAB_MAP_FILE} nor a drafter config.json",
                               "give a vocab_map stage folder, a SpecForge .pt file or a drafter checkpoint")
        where, tensors = path / "model.safetensors", _drafter_tensors(path)
    else:
        where, tensors = path, _load_tensor_dict(path)
    missing = [name for name in ("d2t", "t2d") if name not in tensors]
    if missing:
        raise RegraftError(where, f"has no {' or '.join(missing)} tensor", "a vocab map holds both d2t and t2d")
    return VocabMap(tensors["d2t"], tensors["t2d"], tensors.get("token_counts"), str(path)).validate()
