"""Data-parallel stages (features, vocab_map, regenerate with `shards=K`): which contiguous part of the data a
part job takes, and the complete part outputs a join reads. The parts in order are the whole data in order, so a
join equals one unsharded run."""
from __future__ import annotations

from typing import Any

from stages.common.artifacts import read_manifest
from stages.common.errors import RegraftError


def part_slice(count: int, shard: int | None, shards: int, stage: str, items: str = "conversations") -> slice:
    """Part `shard` of `shards` contiguous parts of `count` items; all of them for shard=None."""
    if shard is None:
        return slice(0, count)
    if shard >= shards:
        raise RegraftError(f"{stage}.shard={shard}", f"there are {shards} shards (0 to {shards - 1})",
                           f"set {stage}.shard= below {shards}")
    if shards > count:  # some part would be empty
        raise RegraftError(f"{stage}.shards={shards}", f"more shards than the {count} {items}",
                           f"set {stage}.shards= to at most {count}")
    return slice(shard * count // shards, (shard + 1) * count // shards)


def part_manifests(parts: list[str], stage: str) -> list[dict[str, Any]]:
    """The manifests of a join's parts, each a complete output of `stage`."""
    manifests = [read_manifest(part) for part in parts]
    for part, manifest in zip(parts, manifests):
        if not manifest or manifest.get("stage") != stage:
            raise RegraftError(part, f"not a complete {stage} output", f"run its {stage} job (shard) first")
    return manifests
