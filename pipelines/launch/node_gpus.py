"""The GPUs a node has, where that figure came from, and which of them each local job holds.

In: `launcher.node_gpus` (an int, or None to count them), and for Slurm the partition jobs go to.
Out: `NodeGpus` (the count, whether it is known, what said so, and this machine's ids), and `GpuPool`, which hands
the local launcher's jobs disjoint GPU ids and takes them back when a job's process has ended.

    this_machine(None)           # NodeGpus(count=8, known=True, said="counted here by /dev/nvidia*", ids=("0", ...))
    slurm_node(None, "gpu")      # read from `sinfo -p gpu`: "gpu:h100:8" -> 8; sinfo silent -> 0, not known
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Any

from stages.common.contract.hardware import visible_gpu_ids

SINFO_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class NodeGpus:
    count: int  # GPUs per node that stages may hold
    known: bool  # False: a guess (Slurm did not answer), so no stage is refused for it
    said: str  # where the count came from, for the plan and for an error's problem
    ids: tuple[str, ...] = ()  # on this machine: the ids CUDA numbers them by (what CUDA_VISIBLE_DEVICES takes)


def where_counted() -> str:
    return "CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in os.environ else "/dev/nvidia*"


def this_machine(setting: int | None) -> NodeGpus:
    """The local (and inline) launcher's node: this machine, `setting` GPUs of those it shows (all when None)."""
    ids = tuple(visible_gpu_ids())
    if setting is None:
        return NodeGpus(len(ids), True, f"counted here by {where_counted()}", ids)
    return NodeGpus(setting, True, "launcher.node_gpus", ids[:setting])


def gres_gpus(gres: str) -> int:
    """GPUs in one of sinfo's %G fields: `gpu:8`, `gpu:h100:8(S:0-1)`, `gpu:a100:4,gpu:v100:2` (6), `(null)` (0)."""
    return sum(int(count) for count in re.findall(r"(?:^|,)gpu(?::[^:,()]*)?:(\d+)", gres))


def partition_gpus(listing: str, partition: str | None) -> tuple[int, str] | None:
    """From `sinfo -h -o %P|%G` lines: the GPUs of the partition's largest node and the line that said so; the
    default partition (marked `*`) when `partition` is None; None when the partition is not listed."""
    rows = [line.strip().split("|", 1) for line in listing.splitlines() if "|" in line]
    picked = [(name.rstrip("*"), gres) for name, gres in rows
              if (name.rstrip("*") == partition if partition else name.endswith("*"))]
    if not picked:
        return None
    name, gres = max(picked, key=lambda row: gres_gpus(row[1]))
    return gres_gpus(gres), f"sinfo: partition {name}, gres {gres}"


def slurm_node(setting: int | None, partition: str | None) -> NodeGpus:
    """The Slurm launcher's node: `setting`, else what sinfo says of the partition's nodes, else 0 and not known."""
    if setting is not None:
        return NodeGpus(setting, True, "launcher.node_gpus")
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%P|%G"], capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
        read = partition_gpus(done.stdout, partition) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        read = None
    if read is None:
        where = f"partition {partition}" if partition else "the default partition"
        return NodeGpus(0, False, f"not known: sinfo did not answer for {where} here, so CPU nodes are assumed; "
                                  "set launcher.node_gpus= to the GPUs of a node")
    return NodeGpus(read[0], True, read[1])


class GpuPool:
    """The ids of the local node's GPUs, and the jobs holding them. A job holds its ids until its process has
    ended (a cancelled fine-tune still saving its checkpoint holds them too)."""

    def __init__(self, ids: tuple[str, ...]):
        self.ids = ids
        self.held: list[tuple[Any, tuple[str, ...]]] = []  # (submitit job, its ids)

    def free(self) -> list[str]:
        self.held = [(job, ids) for job, ids in self.held if not job.done()]
        taken = {gpu for _, ids in self.held for gpu in ids}
        return [gpu for gpu in self.ids if gpu not in taken]

    def hold(self, job: Any, ids: tuple[str, ...]) -> None:
        if ids:
            self.held.append((job, ids))
