"""Data-parallel stages (features, vocab_map, regenerate with `parts=K`): which contiguous part of the data a
part job takes, and the complete part outputs a join reads. The parts in order are the whole data in order, so a
join equals one run over all of it."""
from __future__ import annotations

from typing import Any

from stages.common.contract.artifacts import read_manifest
from stages.common.contract.errors import RegraftError


def part_slice(count: int, part: int | None, parts: int, stage: str, items: str = "conversations") -> slice:
    """Part `part` of `parts` contiguous parts of `count` items; all of them for part=None."""
    if part is None:
        return slice(0, count)
    if part >= parts:
        raise RegraftError(f"{stage}.part={part}", f"there are {parts} parts (0 to {parts - 1})",
                           f"set {stage}.part= below {parts}")
    if parts > count:  # some part would be empty
        raise RegraftError(f"{stage}.parts={parts}", f"more parts than the {count} {items}",
                           f"set {stage}.parts= to at most {count}")
    return slice(part * count // parts, (part + 1) * count // parts)


def part_manifests(part_outputs: list[str], stage: str) -> list[dict[str, Any]]:
    """The manifests of a join's part outputs, each a complete output of `stage`."""
    manifests = [read_manifest(part) for part in part_outputs]
    for part, manifest in zip(part_outputs, manifests):
        if not manifest or manifest.get("stage") != stage:
            raise RegraftError(part, f"not a complete {stage} output", f"run its {stage} part job first")
    return manifests
