"""The regenerate stage's config (stages/regenerate.py), its rules, and what it asks of the machine it runs on."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Holds
from stages.common.contract.stage import register_schema, setting
from stages.common.engines.credentials import DEFAULT_KEY_ENV, refuse_secrets
from stages.common.engines.vllm_engine import VllmConfig, check_engine, engine_holds


class Engine(str, Enum):
    vllm = "vllm"  # vLLM's offline engine in the engine venv on `target`, batched by turn depth
    openai = "openai"  # an OpenAI-compatible server (SGLang, vLLM) at `server_url`, turn by turn per sample


@dataclass
class RegenerateConfig:
    data: str = MISSING  # chat JSONL: {"messages": [...]} per line, an optional "id"
    out: str = MISSING
    target: Optional[str] = None  # HF model folder: the vllm engine's model and chat template (openai: recorded)
    engine: Engine = Engine.vllm
    server_url: Optional[str] = None  # openai: http://host:port of a running server (no /v1)
    model: Optional[str] = None  # openai: the served model's name; None: the one /v1/models lists
    api_key_env: str = DEFAULT_KEY_ENV  # openai: the environment variable holding the server's --api-key (if any)
    api_key: Optional[str] = None  # never set: refused (a setting is written to .hydra/, manifests, MLflow)
    temperature: float = setting(0.0, at_least=0)  # 0: greedy
    top_p: float = setting(1.0, above=0, at_most=1)
    max_tokens: int = setting(2048, at_least=1)  # per answer
    seed: int = 0  # every sample's seeds derive from it and the sample's id: a rerun asks the same
    num_samples: Optional[int] = setting(None, at_least=1)  # the first N samples of data; None: all
    concurrency: int = setting(64, at_least=1)  # openai: requests in flight
    retries: int = setting(3, at_least=0)  # openai: tries more when the server does not answer (not a refusal)
    request_timeout_s: float = setting(600.0, above=0)  # openai: one request
    extra_body: dict[str, Any] = field(default_factory=dict)  # openai: merged into every request
    batch_size: int = setting(1024, at_least=1)  # vllm: samples per chunk; a kill loses at most one chunk's work
    dtype: str = "auto"  # vllm: the engine's dtype (auto: the target's own)
    trust_remote_code: bool = False  # vllm: run the tokenizer code in the target's folder (Kimi's)
    work_dir: Optional[str] = None  # finished samples across kills; None: <out>.work
    # across nodes: the pipeline splits the samples into this many contiguous parts, one job and one cached output
    # each (`part`), and a join (`part_outputs`) writes their lines in order: the same files as one job would
    parts: int = setting(1, at_least=1)
    part: Optional[int] = setting(None, at_least=0)  # this job's part of `parts`; None: all the samples
    part_outputs: list[str] = field(default_factory=list)  # join: complete part outputs, in order; nothing is asked
    vllm: VllmConfig = field(default_factory=VllmConfig)


def check_regenerate(cfg: DictConfig, where: str) -> None:
    prefix = f"{where}." if where else ""
    refuse_secrets(cfg, where)
    if Engine(cfg.engine) is Engine.openai and not cfg.server_url:
        raise RegraftError(f"{prefix}server_url", "engine=openai needs a server",
                           f"set {prefix}server_url=http://HOST:PORT of a running SGLang or vLLM server")
    if Engine(cfg.engine) is Engine.vllm and cfg.extra_body:
        raise RegraftError(f"{prefix}extra_body", "is sent to servers only (engine=openai)",
                           f"drop {prefix}extra_body, or set {prefix}engine=openai")


def check_regenerate_engine(cfg: DictConfig, where: str) -> None:
    """Where the stage will run (pipeline.regenerate, or the stage alone): its engine venv exists. Not a schema
    rule: every pipeline config holds a regenerate group, and one that never regenerates needs no vLLM."""
    if Engine(cfg.engine) is Engine.vllm:
        check_engine(cfg.vllm, f"{where}." if where else "")


def check_before_work(cfg: dict, stage: str) -> None:
    """What the pipeline asks of every stage before any work (pipelines/launchers.py): its engine can start here."""
    check_regenerate_engine(OmegaConf.create(cfg), stage)


def holds(cfg: DictConfig | dict, node_gpus: int) -> Holds:
    """The vllm engine on as many GPUs as it is tensor-parallel on a GPU node; the openai engine asks a server that
    runs elsewhere (nothing here)."""
    if Engine(cfg["engine"]) is not Engine.vllm:
        return Holds()
    return engine_holds(int(cfg["vllm"]["tensor_parallel_size"]), node_gpus, "vLLM")


register_schema("regenerate", RegenerateConfig, check=check_regenerate)
