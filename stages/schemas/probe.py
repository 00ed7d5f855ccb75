"""The probe stage's config (stages/probe.py), its rules, and what it asks of the machine it runs on."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from omegaconf import MISSING, DictConfig, OmegaConf

from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Holds
from stages.common.contract.stage import register_schema, setting
from stages.common.data.chat_prompts import EvalSet, check_eval_sets
from stages.common.engines.engine_process import interpreter_found
from stages.common.engines.sglang_backend import SglangConfig
from stages.common.engines.vllm_engine import (VllmConfig, check_engine, check_engine_here, check_mla_target,
                                                engine_holds)


class Backend(str, Enum):
    hf = "hf"  # local transformers target, greedy speculative decoding checked against plain greedy
    vllm = "vllm"  # vLLM's offline engine in its own venv, checked lossless against vLLM plain greedy and hf
    sglang = "sglang"  # a real SGLang server (started here, or `sglang.server_url`)


DTYPES = ("float32", "bfloat16", "float16")  # what the hf backend runs a target and a drafter in


@dataclass
class ProbeConfig:
    target: str = MISSING  # HF model folder of the target (verifier)
    drafter: str = MISSING  # drafter checkpoint folder, or a finetune output folder holding drafter/
    out: str = MISSING
    backend: Backend = Backend.hf  # hf: local greedy speculative decoding, checked lossless | sglang: a server
    # {name, path}: builtin | a JSONL of {"messages": [...]} (user turns are the prompts), each measured on its own
    eval_sets: list[EvalSet] = field(default_factory=lambda: [EvalSet("builtin", "builtin")])
    num_prompts: int = setting(8, at_least=1)  # conversations per set, picked by a seeded shuffle
    max_new_tokens: int = setting(64, at_least=1)
    seed: int = 0
    num_steps: int = setting(3, at_least=1)  # draft tokens per verify step (chain drafting)
    topk: int = setting(1, at_least=1)  # sglang only; the hf backend drafts a chain
    num_draft_tokens: int = setting(4, at_least=2)  # sglang: tokens verified per step (num_steps + 1 for a chain)
    dtype: str = "float32"  # hf: target and drafter dtype
    trust_remote_code: bool = False  # run the code in the target's folder (Kimi's tokenizer and model need it)
    check_hf: bool = True  # vllm: also hold every answer against the hf target's greedy ids (off for targets HF
    # cannot load, e.g. Kimi-K2.5)
    sglang: SglangConfig = field(default_factory=SglangConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)


def check_probe(cfg: DictConfig, where: str) -> None:
    prefix = f"{where}." if where else ""
    check_eval_sets(cfg.eval_sets, f"{prefix}eval_sets")
    if Backend(cfg.backend) is Backend.vllm:
        check_engine(cfg.vllm, prefix)
        check_vllm_targets(cfg, where)
    if Backend(cfg.backend) is not Backend.sglang and cfg.topk != 1:
        raise RegraftError(f"{prefix}topk={cfg.topk}",
                           f"the {Backend(cfg.backend).value} backend drafts a chain (topk 1)",
                           f"set {prefix}topk=1, or {prefix}backend=sglang")
    if cfg.dtype not in DTYPES:
        raise RegraftError(f"{prefix}dtype={cfg.dtype}", "is not a dtype the probe runs in",
                           f"set {prefix}dtype= to {', '.join(DTYPES[:-1])} or {DTYPES[-1]}")


def check_vllm_targets(cfg: DictConfig, where: str) -> None:
    """No MLA target on vLLM's CPU build (vllm_engine.check_mla_target): asked of the stage run alone (check_probe)
    and of every probe node of a pipeline, evaluate and baseline_evaluate too (pipelines/modes/preflight.py)."""
    prefix = f"{where}." if where else ""
    if Backend(cfg.backend) is Backend.vllm:
        check_mla_target(cfg.vllm, cfg.get("target"), prefix, f"{prefix}backend=hf (transformers)", "its accept_len")


def check_before_work(cfg: dict, stage: str) -> None:
    """What the pipeline asks of every stage before any work, where it will run (pipelines/launch/): the
    engine's interpreter is there, and this machine can run it as asked."""
    backend = Backend(cfg["backend"])
    if backend is Backend.vllm:
        check_engine_here(OmegaConf.create(cfg["vllm"]), f"{stage}.", cfg.get("target"))
    sglang = cfg["sglang"]
    if backend is Backend.sglang and not sglang["server_url"] and not interpreter_found(sglang["python"]):
        raise RegraftError(f"{stage}.sglang.python={sglang['python']}", "no such interpreter here",
                           f"set {stage}.sglang.python= to an interpreter with sglang installed, or "
                           f"{stage}.backend=vllm")


def holds(cfg: DictConfig | dict, node_gpus: int) -> Holds:
    """The engine it serves the target and drafter with, on as many GPUs as it is tensor-parallel on a GPU node:
    SGLang's server (one at sglang.server_url runs elsewhere: nothing here) or vLLM's engine; hf a CPU."""
    backend = Backend(cfg["backend"])
    if backend is Backend.sglang and not cfg["sglang"]["server_url"]:
        tensor_parallel, server = int(cfg["sglang"]["tp"]), "SGLang"
    elif backend is Backend.vllm:
        tensor_parallel, server = int(cfg["vllm"]["tensor_parallel_size"]), "vLLM"
    else:
        return Holds()
    return engine_holds(tensor_parallel, node_gpus, server)


register_schema("probe", ProbeConfig, check=check_probe)
