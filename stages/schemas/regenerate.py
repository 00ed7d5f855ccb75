"""The regenerate stage's config (stages/regenerate.py), its rules, and what it asks of the machine it runs on."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Holds, gpu_visible
from stages.common.contract.stage import register_schema, setting
from stages.common.engines.credentials import DEFAULT_KEY_ENV, refuse_secrets
from stages.common.engines.engine_process import interpreter_found, on_this_machine
from stages.common.engines.sglang_backend import SglangConfig
from stages.common.engines.vllm_engine import VllmConfig, check_engine, check_mla_target, engine_holds


class Engine(str, Enum):
    vllm = "vllm"  # vLLM's offline engine in the engine venv on `target`, batched by turn depth
    # an OpenAI-compatible server (SGLang, vLLM), turn by turn per sample: the one at `server_url`, or one the stage
    # starts on `target` (`serve`)
    openai = "openai"


class Serve(str, Enum):
    """The OpenAI server the stage starts on its own node for as long as it runs (engine=openai, no server_url): it
    holds the node's GPUs while regenerate runs (`holds`), so no other stage's engine starts on them meanwhile."""

    sglang = "sglang"  # python -m sglang.launch_server, set by `sglang` (interpreter, tp, memory, extra flags)
    vllm = "vllm"  # vLLM's OpenAI server from the engine venv, set by `vllm` (interpreter, tensor-parallel, memory)


@dataclass
class RegenerateConfig:
    data: str = MISSING  # chat JSONL: {"messages": [...]} per line, an optional "id"
    out: str = MISSING
    target: Optional[str] = None  # HF model folder: the vllm engine's model and chat template (openai: recorded)
    engine: Engine = Engine.vllm
    server_url: Optional[str] = None  # openai: http://host:port of a running server on another node (no /v1)
    serve: Optional[Serve] = None  # openai without server_url: start this server on `target` here, for the stage's life
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
    vllm: VllmConfig = field(default_factory=VllmConfig)  # vllm, and serve=vllm: its engine
    sglang: SglangConfig = field(default_factory=SglangConfig)  # serve=sglang: its server (its server_url unread)


def check_regenerate(cfg: DictConfig, where: str) -> None:
    prefix = f"{where}." if where else ""
    refuse_secrets(cfg, where)
    if Engine(cfg.engine) is Engine.openai and not cfg.server_url and cfg.serve is None:
        raise RegraftError(f"{prefix}server_url", "engine=openai needs a server",
                           f"set {prefix}server_url=http://HOST:PORT of a running SGLang or vLLM server, or "
                           f"{prefix}serve=sglang (or vllm) to start one on the target here")
    if Engine(cfg.engine) is Engine.vllm and cfg.extra_body:
        raise RegraftError(f"{prefix}extra_body", "is sent to servers only (engine=openai)",
                           f"drop {prefix}extra_body, or set {prefix}engine=openai")


def started_here(cfg: DictConfig | dict) -> Optional[Serve]:
    """The server the stage starts itself (engine=openai, `serve` without `server_url`), or None."""
    if Engine(cfg["engine"]) is not Engine.openai or cfg["server_url"] or cfg["serve"] is None:
        return None
    return Serve(cfg["serve"])


def check_regenerate_engine(cfg: DictConfig, where: str) -> None:
    """Where the stage will run (pipeline.regenerate, or the stage alone): the interpreter of the engine it starts
    exists. Not a schema rule: every pipeline config holds a regenerate group, and one that never regenerates needs
    no engine."""
    prefix = f"{where}." if where else ""
    serve = started_here(cfg)
    if Engine(cfg.engine) is Engine.vllm or serve is Serve.vllm:
        check_engine(cfg.vllm, prefix)
        check_vllm_targets(cfg, where)
    if serve is Serve.sglang and not interpreter_found(cfg.sglang.python):
        raise RegraftError(f"{prefix}sglang.python={cfg.sglang.python}", "no such interpreter here",
                           f"set {prefix}sglang.python= to an interpreter with sglang installed, or {prefix}serve=vllm")


def check_vllm_targets(cfg: DictConfig, where: str) -> None:
    """No MLA target on vLLM's CPU build, its offline engine or the server it starts (vllm_engine.check_mla_target):
    asked where the stage will run (check_regenerate_engine) and of a pipeline's regenerate nodes
    (pipelines/modes/preflight.py)."""
    prefix = f"{where}." if where else ""
    if Engine(cfg.engine) is Engine.vllm or started_here(cfg) is Serve.vllm:
        check_mla_target(cfg.vllm, cfg.get("target"), prefix, f"{prefix}engine=openai with {prefix}server_url= of "
                         "a server on a GPU", "the answers it writes")


def check_before_work(cfg: dict, stage: str) -> None:
    """What the pipeline asks of every stage before any work (pipelines/launch/): its engine can start here,
    and a server it is given runs on no GPU of this node, where the pipeline's other engines would start beside it
    unaware (none of them knows what a server it did not start holds)."""
    check_regenerate_engine(OmegaConf.create(cfg), stage)
    url = cfg["server_url"]
    if Engine(cfg["engine"]) is Engine.openai and url and gpu_visible() and on_this_machine(url):
        raise RegraftError(f"{stage}.server_url={url}", "is a server on this GPU node, where the pipeline's own "
                           "engines (probe, features, the fine-tunes) would start on the GPUs it holds",
                           f"unset {stage}.server_url and set {stage}.serve=sglang (or vllm): the stage then starts "
                           "its own server and holds the GPUs while it runs; or serve it from another node")


def holds(cfg: DictConfig | dict, node_gpus: int) -> Holds:
    """The engine it runs or starts, on as many GPUs as it is tensor-parallel on a GPU node: vLLM's offline engine,
    or the server `serve` starts; a server at server_url runs elsewhere (nothing here)."""
    serve = started_here(cfg)
    if serve is Serve.sglang:
        return engine_holds(int(cfg["sglang"]["tp"]), node_gpus, "SGLang")
    if Engine(cfg["engine"]) is Engine.vllm or serve is Serve.vllm:
        return engine_holds(int(cfg["vllm"]["tensor_parallel_size"]), node_gpus, "vLLM")
    return Holds()


register_schema("regenerate", RegenerateConfig, check=check_regenerate)
