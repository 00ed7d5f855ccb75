"""The draft vocabulary map, as real checkpoints hold it.

`d2t[p] = target_id[p] - p` (int64 [N]) and `t2d` (bool [V], True for ids in the draft vocab); the target id of
draft position p is `d2t[p] + p`. A map is read from a vocab_map stage folder, a SpecForge `.pt` file
(`{"d2t", "t2d"}`), or a drafter checkpoint (its own map).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common.errors import RegraftError

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

    @property
    def is_sorted(self) -> bool:
        ids = self.target_ids
        return bool((ids[1:] > ids[:-1]).all())

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
    from stages.common.tensor_io import SafetensorsFiles

    files = SafetensorsFiles.open_file(path)
    return {name: files.get(name) for name in ("d2t", "t2d", "token_counts") if name in files}


def load_vocab_map(path: str | Path) -> VocabMap:
    """Read a map from a vocab_map folder, a `.pt`/`.safetensors` file, or a drafter checkpoint folder."""
    path = Path(path)
    if not path.exists():
        raise RegraftError(path, "vocab map not found",
                           "give a vocab_map stage folder, a SpecForge .pt file or a drafter checkpoint folder")
    if path.is_dir():
        if (path / VOCAB_MAP_FILE).exists():
            file = path / VOCAB_MAP_FILE
        elif (path / "config.json").exists():
            from stages.common.checkpoint import DrafterCheckpoint

            return DrafterCheckpoint.open(path).vocab_map()
        else:
            raise RegraftError(path, f"folder has neither {VOCAB_MAP_FILE} nor a drafter config.json",
                               "give a vocab_map stage folder, a SpecForge .pt file or a drafter checkpoint")
    else:
        file = path
    tensors = _load_tensor_dict(file)
    missing = [name for name in ("d2t", "t2d") if name not in tensors]
    if missing:
        raise RegraftError(file, f"has no {' or '.join(missing)} tensor", "a vocab map holds both d2t and t2d")
    return VocabMap(tensors["d2t"], tensors["t2d"], tensors.get("token_counts"), str(file)).validate()
