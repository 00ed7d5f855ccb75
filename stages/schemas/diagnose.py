"""The diagnose stage's config (stages/diagnose.py): the drafter, both targets, the rows it measures and the fit, where
the targets run, and what it asks of the machine it runs on."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING, DictConfig

from stages.common.contract.hardware import Holds
from stages.common.contract.stage import register_schema, setting
from stages.common.drafter.loss_mask import LossMask
from stages.common.engines.vllm_engine import (VllmConfig, check_engine, check_extraction_here, check_mla_target,
                                                engine_holds)


class Backend(str, Enum):
    hf = "hf"  # both targets in transformers, float32, in this process (small targets)
    # each target's states from vLLM's offline engine, extracted as the features stage extracts them; its token
    # embeddings and lm_head read from its folder: no target is ever loaded in transformers (a 1T MoE cannot be)
    vllm = "vllm"


@dataclass
class DiagnoseConfig:
    drafter: str = MISSING  # the remapped source drafter (a remap output), or any drafter on the training map
    target: str = MISSING  # the new target (B)
    target_a: Optional[str] = None  # the target the source drafter was trained for; None: no drift numbers
    data: str = MISSING  # B-domain chats (the training data)
    vocab_map: str = MISSING  # the training map
    out: str = MISSING
    max_rows: int = setting(64, at_least=2)  # conversations measured (half fit the maps, half are held out)
    max_length: int = setting(256, at_least=4)
    fit_share: float = setting(0.5, above=0, below=1)  # share of the rows the ridge maps are fitted on
    ridge: float = setting(1e-3, at_least=0)  # x the mean eigenvalue of B's Gram matrix (drift.RIDGE's value)
    realign_embeddings: bool = True  # also fold a map of the token embeddings into the drafter's first layer
    ttt_steps: int = setting(3, at_least=1)
    loss_mask: LossMask = LossMask.drafted
    trust_remote_code: bool = False
    seed: int = 0
    # where the targets run (the pipeline takes these four from the features stage: conf/wiring/default.yaml)
    backend: Backend = Backend.hf  # hf: transformers here | vllm: vLLM's engine, one target after the other
    vllm: VllmConfig = field(default_factory=VllmConfig)
    vllm_connector: str = "cpu"  # cpu: regraft's connector (a CPU build) | stock: vLLM's own (GPU)
    dtype: str = "float32"  # vllm: the engine's dtype (the math is float32 either way; the hf path runs float32)


def check_diagnose(cfg: DictConfig, where: str) -> None:
    if Backend(cfg.backend) is Backend.vllm:
        check_engine(cfg.vllm, f"{where}." if where else "")
        check_vllm_targets(cfg, where)


def check_vllm_targets(cfg: DictConfig, where: str) -> None:
    """Neither target is MLA on vLLM's CPU build (vllm_engine.check_mla_target): asked of the stage run alone
    (check_diagnose) and of a pipeline's diagnose node (pipelines/modes/preflight.py), whose backend follows
    features.backend (conf/wiring)."""
    prefix = f"{where}." if where else ""
    if Backend(cfg.backend) is Backend.vllm:
        for target in (cfg.get("target"), cfg.get("target_a")):
            check_mla_target(cfg.vllm, target, prefix, f"{prefix}backend=hf (transformers; a pipeline's follows "
                             "features.backend)", "its states, drift and step-0 losses")


def check_before_work(cfg: dict, stage: str) -> None:
    """What the pipeline asks of every stage before any work, where it will run (pipelines/launch/): an engine
    this machine can run as asked."""
    if Backend(cfg["backend"]) is Backend.vllm:
        check_extraction_here(cfg, stage)


def holds(cfg: DictConfig | dict, node_gpus: int) -> Holds:
    """The vllm backend's engine (one target at a time) on as many GPUs as it is tensor-parallel on a GPU node; the
    hf backend a CPU."""
    if Backend(cfg["backend"]) is not Backend.vllm:
        return Holds()
    return engine_holds(int(cfg["vllm"]["tensor_parallel_size"]), node_gpus, "vLLM")


register_schema("diagnose", DiagnoseConfig, check=check_diagnose)
