"""Where a fine-tune's ranks compute, and what a GPU run needs around it: the device each rank takes, the process
group's backend, the GPUs DeepSpeed's launcher is given, and one online-features server per node.

    device = training_device(Device.auto)         # cuda:LOCAL_RANK on a GPU node, the CPU elsewhere
    with node_states_server(cfg, work) as cfg:    # features.mode=online: engine.server_url of this node's server
        ...
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Device, gpu_visible, visible_gpu_ids

CUDA_TORCH_FIX = "install a CUDA build of torch in this venv (docs/scale-out.md, 'A GPU node'), or set finetune.device=cpu"


def training_device(device: Device | str) -> torch.device:
    """The device this rank trains on: `cuda:LOCAL_RANK` where a GPU is asked for or (auto) where torch sees one, the
    CPU otherwise. A machine with GPUs whose torch sees none (a CPU build) is refused, not trained on in fp32 on the
    CPU: that is a wrong install, and a run on it would take days and say nothing."""
    device = Device(device)
    if device is Device.cpu:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device is Device.cuda:
        raise RegraftError(f"finetune.device={device.value}", f"torch {torch.__version__} sees no GPU here",
                           CUDA_TORCH_FIX)
    if gpu_visible():
        raise RegraftError("finetune.device=auto", f"this machine has GPUs (/dev/nvidia*) but torch {torch.__version__} "
                           "sees none, so the fine-tune would run on the CPU in fp32", CUDA_TORCH_FIX)
    return torch.device("cpu")


def uses_gpus(device: Device | str) -> bool:
    """Whether ranks started here will train on GPUs (the launching process, which is no rank itself)."""
    return Device(device) is not Device.cpu and torch.cuda.is_available()


def deepspeed_devices(nproc: int, device: Device | str) -> list[str]:
    """DeepSpeed launcher arguments for the GPUs its `nproc` ranks take. `--num_gpus N` takes GPUs 0..N-1 whatever
    CUDA_VISIBLE_DEVICES says (it drops the variable), so GPUs a scheduler gave this job are named with `--include`."""
    ids = visible_gpu_ids() if uses_gpus(device) and "CUDA_VISIBLE_DEVICES" in os.environ else []
    if not ids:
        return ["--num_gpus", str(nproc)]
    if len(ids) < nproc:
        raise RegraftError(f"finetune.nproc={nproc}", f"this job was given {len(ids)} GPU(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})",
                           f"set finetune.nproc={len(ids)}, or give the job {nproc} GPUs")
    return ["--include", "localhost:" + ",".join(ids[:nproc])]


@contextlib.contextmanager
def node_states_server(cfg: DictConfig, work: Path) -> Iterator[DictConfig]:
    """Online features (engine.enabled) without a server URL: each node's local rank 0 starts the target's server on
    its node's GPUs (the ranks share them, so `engine.vllm.gpu_memory_utilization` leaves room for training), every
    rank learns its own node's URL, and the server stops once every rank is done. Given a URL, or offline, `cfg` as
    it is. A launcher that starts the ranks itself (torchrun, deepspeed) starts the server before them instead
    (stages/finetune/__init__.py: `run`), so the ranks it starts find a URL here."""
    engine = cfg.get("engine")
    if engine is None or not engine.enabled:
        yield cfg
        return
    from stages.common.engines.vllm_states import states_server
    from stages.finetune import aux_layers_of, initial_config  # the package, loaded by now: no circle at import

    if engine.server_url:  # one somebody started (the user, or the process that launched these ranks): checked
        with states_server(engine, cfg.target, aux_layers_of(initial_config(cfg)), cfg.max_length, work / "engine"):
            yield cfg
        return
    host = socket.gethostname()
    first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    folder = work / "engine" / (host if int(os.environ.get("SLURM_NNODES", "1")) > 1 else "")  # nodes share `work`
    with states_server(engine, cfg.target, aux_layers_of(initial_config(cfg)), cfg.max_length,
                       folder) if first_on_node else contextlib.nullcontext() as url:
        urls = gathered((host, url))
        mine = next(found for name, found in urls if name == host and found)
        try:
            yield OmegaConf.merge(cfg, {"engine": {"server_url": mine}})
        finally:
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                torch.distributed.barrier()  # the server stays up until every rank of its node is done with it


def gathered(value: object) -> list[object]:
    """`value` from every rank, in rank order (itself alone without a process group of several ranks)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [value]
    values: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values
