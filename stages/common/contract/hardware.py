"""What a stage holds on the node it runs on, and the GPUs a machine shows; no torch.

Each stage's schema module (stages/schemas/) may define `holds(cfg, node_gpus) -> Holds`: from the stage's own config
and the GPUs a node has (`launcher.node_gpus`), the GPUs it occupies for its whole run (an engine at tensor-parallel
8, a fine-tune's ranks), its rank layout, and the server it starts. Both launchers read it (pipelines/launch/):
Slurm asks for it in each job, the local launcher never runs two stages whose GPUs would collide. A stage without
`holds` holds nothing but a CPU.

    holds = schema_module("finetune").holds(config, node_gpus=8)   # Holds(gpus=8, tasks_per_node=8, ...)
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path


# share of a GPU's memory a plan keeps free for what a memory estimate leaves out: the CUDA context, NCCL's buffers,
# the caching allocator's fragments (stages/common/drafter/memory.py)
MEMORY_HEADROOM = 0.1


class Device(str, Enum):
    """Where a stage computes."""

    auto = "auto"  # a GPU where torch sees one, else the CPU
    cuda = "cuda"  # a GPU, or the stage refuses to start
    cpu = "cpu"  # the CPU, even on a machine with GPUs


@dataclass(frozen=True)
class Holds:
    """What one node of a stage's job occupies while it runs."""

    gpus: int = 0  # GPUs per node, for the whole run
    nodes: int = 1
    tasks_per_node: int = 1  # processes per node: a fine-tune's ranks, one task each on Slurm
    server: str | None = None  # the engine it starts on those GPUs ("vLLM, tensor-parallel 8"); None: none

    def describe(self) -> str:
        shape = f"{self.nodes} node(s) x {self.tasks_per_node} task(s)"
        gpus = f", {self.gpus} GPU(s) a node" if self.gpus else ", no GPU"
        return shape + gpus + (f", serving {self.server}" if self.server else "")


def visible_gpu_ids() -> list[str]:
    """The GPUs this machine shows, as CUDA numbers them for this process: `CUDA_VISIBLE_DEVICES` where it is set
    (what a scheduler or a launcher gave this process), else one per NVIDIA device node (`/dev/nvidia0`, ...).
    Read without importing torch, so a check on a CPU machine costs nothing."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [part.strip() for part in given.split(",") if part.strip() and part.strip() != "-1"]
    nodes = (path.name for path in Path("/dev").glob("nvidia[0-9]*"))
    return sorted((name[len("nvidia"):] for name in nodes if re.fullmatch(r"nvidia[0-9]+", name)), key=int)


def gpu_visible() -> bool:
    """Whether this machine shows a GPU (an NVIDIA or ROCm device node), read without importing torch."""
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


def on_gpu(device: Device | str, node_gpus: int) -> bool:
    """Whether a stage with this `device` computes on GPUs on a node that has `node_gpus`."""
    device = Device(device)
    return device is Device.cuda or (device is Device.auto and node_gpus > 0)
