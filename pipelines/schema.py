"""Typed schemas of the pipeline-level config: the inputs (target, source, data), the launcher, tracking, and the
root config itself (conf/config.yaml pulls `/schema/regraft`), so a typo anywhere fails at composition.

The stages' own schemas are in stages/schemas/ (one module per stage, none importing torch or the stage's
code); their defaults live there, once. The root has a field for each stage the registry holds
(pipelines/core/registry.py).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, make_dataclass
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from pipelines.core.registry import STAGES, StageEntry
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import CHECKS, check_config, register_schema, setting
from stages.common.data.chat_prompts import EvalSet, check_eval_sets
from stages.common.data.named import describe
from stages.common.drafter.config import check_family
from stages.schemas.finetune import FinetuneConfig, Init


@dataclass
class TargetConfig:
    path: str = MISSING  # model folder (config.json, safetensors, tokenizer), or @world/target_b
    name: Optional[str] = None  # the hub id it is deployed by: exported drafters name their verifier by it (None:
    # the path above, or none for a stage output such as @world/target_b, which exists in this cache only)
    trust_remote_code: bool = False  # every stage that loads the target runs the code in its folder (Kimi's)


@dataclass
class SourceBuild:
    """How regraft trains the built-in world's source drafter itself (source=toy): a vocab_map of `draft_vocab_size`
    on `data`, then a from-scratch finetune on `target`: the finetune stage's own defaults with `finetune` on top
    (keys of FinetuneConfig; the pipeline's `finetune` group never reaches it). Its values: conf/source/toy.yaml."""

    target: str = "@world/target_a"
    data: str = "@world/data_a.jsonl"
    draft_vocab_size: int = setting(1024, at_least=1)
    family: str = "eagle3"  # eagle3 | eagle3.1 | mla | mla3.1 (stages/common/drafter/config.py FAMILY_FLAGS)
    # keys of the finetune stage (settings_of: what an unknown key is held against, pipelines/config_errors.py)
    finetune: dict[str, Any] = field(default_factory=dict, metadata={"settings_of": "finetune"})


@dataclass
class SourceConfig:
    path: str = MISSING  # drafter folder, sglang or speculators layout, or @source_drafter/drafter
    build: Optional[SourceBuild] = None  # set only for a drafter regraft trains itself (the built-in world's)
    family: Optional[str] = None  # its family, which the from-scratch baseline builds too (conf/wiring); None: a
    # given checkpoint's own (pipelines/core/dag.py), eagle3 without one
    target: Optional[str] = None  # the target the drafter was trained for (diagnose's target A, realign's source);
    # None: build.target for the built-in drafter (path @source_drafter/...), else unknown (diagnose then gives what it can without it)


def check_source(cfg, where: str) -> None:
    """A family the user names for the source (or its build) is one regraft builds, named as the user wrote it; the
    build's fine-tune settings keep the finetune stage's bounds, named where they are set (source.build.finetune.lr),
    not as the pipeline's own fine-tune (finetune.lr), which the source's build never reads."""
    named = {f"{where}.build.family": cfg.build.get("family")} if cfg.get("build") is not None else {}
    named[f"{where}.family"] = cfg.get("family")  # the build's, unless set: the build is named first
    for key, family in named.items():
        check_family(key, family)
    if cfg.get("build") is not None:
        from pipelines.core.dag import built_finetune

        settings = OmegaConf.to_container(cfg.build.finetune, resolve=True)
        check_config(built_finetune(settings), FinetuneConfig, f"{where}.build.finetune")


CHECKS[SourceConfig] = check_source


@dataclass
class DataConfig:
    # chat JSONL for vocab_map, features and finetune (pipeline.regenerate: the prompts the new target answers
    # first), or a named set (sharegpt, ultrachat) or {name, dataset, split, ...}: stages/common/data/named.py
    train: Any = MISSING
    # each a {name, path} chat JSONL whose user turns the probe asks (phase 0 and 1), or builtin; or a named set
    # (mtbench, humaneval, gsm8k, math500) or {name, dataset, split, ...}; each measured on its own
    eval_sets: list[Any] = field(default_factory=lambda: [EvalSet("builtin", "builtin")])


class LauncherName(str, Enum):
    local = "local"  # submitit's local executor: one process per stage on this machine
    slurm = "slurm"  # one Slurm job per stage, chained by afterok dependencies
    inline = "inline"  # every stage in this process (debugging)


@dataclass
class LauncherConfig:
    name: LauncherName = MISSING
    poll_s: float = setting(0.2, at_least=0)  # how often the orchestrator looks at running jobs
    resources: dict[str, Any] = field(default_factory=dict)  # submitit parameters for every job
    per_stage: dict[str, Any] = field(default_factory=dict)  # the same by stage, over `resources`: every node of
    # the stage (per_stage.finetune: finetune, baseline_finetune, source_drafter, a race's rungs; per_stage.probe:
    # probe, evaluate, baseline_evaluate, a race finalist's evaluation); keys are stages only (stages/*)
    per_node: dict[str, Any] = field(default_factory=dict)  # the same by node name, over per_stage (`evaluate`;
    # `features` is every part of it too, `features_2` one part)
    # GPUs a node has, for what each stage holds (its schema's `holds`: an engine's tensor-parallel size, a
    # fine-tune's ranks) to be asked of Slurm and handed out locally; None: counted (local: this machine's, by
    # CUDA_VISIBLE_DEVICES or /dev/nvidia*; slurm: sinfo's gres of the partition's nodes, 0 when sinfo does not answer)
    node_gpus: Optional[int] = setting(None, at_least=0)
    max_parallel: Optional[int] = setting(None, at_least=1)  # stage jobs at once (local, inline); None: no limit
    threads: Optional[int] = setting(None, at_least=1)  # torch threads per stage; None: cores // max_parallel
    # local: jobs fork from one interpreter that imported torch and the stages once (pipelines/launch/warm/); false:
    # a fresh interpreter per job. What it buys and costs: docs/speed.md
    warm: bool = True
    python: Optional[str] = None  # slurm: the command that runs Python in a job; None: this interpreter
    max_num_timeout: int = setting(3, at_least=0)  # slurm: requeues of a resumable stage (finetune) at its time limit


@dataclass
class TrackingConfig:
    enabled: bool = True  # false: no MLflow at all
    uri: str = "sqlite:///${paths.outputs}/mlflow.db"  # any tracking URI works (http://host:5000, databricks, ...)
    experiment: str = "regraft"
    artifact_location: str = "${paths.outputs}/mlartifacts"
    copy_checkpoints: bool = False  # big checkpoints are recorded by path and sha256, not copied into the store
    max_artifact_mb: float = setting(20.0, at_least=0)  # files larger than this are recorded, not copied
    # an http store that does not answer: each call gives up after timeout_s and this many retries, and what it
    # did not take waits in `outbox` for the next command (pipelines/tracking/outbox.py); the pipeline never waits on it
    timeout_s: float = setting(10.0, at_least=1)
    retries: int = setting(1, at_least=0)
    outbox: str = "${paths.outputs}/outbox"
    # one process per store keeps MLflow imported and the store open between commands (pipelines/tracking/store_agent.py):
    # a rerun of cache hits pays neither; it ends after agent_idle_s without a command. null: one for a store on this
    # machine (sqlite, a folder), none for a server (http, databricks), where it buys little (docs/speed.md);
    # false: each command opens the store itself
    agent: Optional[bool] = None
    agent_idle_s: float = setting(600.0, above=0)


@dataclass
class PipelineSwitches:
    regenerate: bool = False  # the new target answers data.train first; vocab_map, features and finetune read that
    probe: bool = True  # phase 0: the source drafter on the new target, as it is
    # the fine-tunes train on the target's states from features.mode's source: cached once (offline), or a vLLM
    # server per batch (online); false: the target runs in transformers inside every fine-tune step
    offline: bool = True
    baseline: bool = True  # a from-scratch fine-tune + evaluate beside the remapped one
    diagnose: bool = True  # how far the target moved for the drafter (needs source.target for the drift numbers)
    race: bool = False  # race.inits x race.lrs under one budget instead of one fine-tune (pipelines/modes/race.py)
    evaluate: bool = True  # phase 1: the fine-tuned drafters, measured as the probe measures
    plan: bool = False  # check everything, print the DAG and its cost, write plan.json; run nothing (pipelines/modes/plan.py)


def default_devices() -> dict[str, dict[str, Any]]:
    """{device: {tflops, utilisation, memory_gb}}: peak dense TFLOP/s of the training dtype, bf16 (None: measured
    here, float32), the share of it the stages reach, and one GPU's memory (the plan checks a fine-tune rank's peak
    against it). Per GPU, dense (half the datasheets' "with sparsity" figures), from NVIDIA's datasheets:

    | GPU                      | bf16 TFLOP/s | fp8 TFLOP/s | memory                                    |
    | A100 SXM                 |   312        |   -         |  80 GB                                    |
    | H100 SXM, H200 SXM       |   989        | 1,979       |  80 GB, 141 GB                            |
    | B200 (HGX B200)          | 2,250        | 4,500       | 180 GB (1,440 GB over 8; the chip 192)    |
    | GB200 (GB200 NVL72)      | 2,500        | 5,000       | 186 GB (13.4 TB over 72)                  |
    | B300 (HGX B300)          | 2,250        | 4,500       | 288 GB (2.3 TB over 8)                    |

    The fine-tunes train in bf16, so `tflops` is the bf16 column; a run priced for FP8 training sets
    `plan.devices.<gpu>.tflops` to the fp8 one. The 40% utilisation is an assumption, set it to what your runs
    reach."""
    return {"cpu": {"tflops": None, "utilisation": 1.0, "memory_gb": None},
            "b200": {"tflops": 2250.0, "utilisation": 0.4, "memory_gb": 180.0},
            "gb200": {"tflops": 2500.0, "utilisation": 0.4, "memory_gb": 186.0},
            "b300": {"tflops": 2250.0, "utilisation": 0.4, "memory_gb": 288.0},
            "h200": {"tflops": 989.0, "utilisation": 0.4, "memory_gb": 141.0},
            "h100": {"tflops": 989.0, "utilisation": 0.4, "memory_gb": 80.0},
            "a100": {"tflops": 312.0, "utilisation": 0.4, "memory_gb": 80.0}}


@dataclass
class PlanConfig:
    """pipeline.plan: what the estimates of pipelines/modes/estimates.py assume."""

    device: str = "cpu"  # a key of devices: the GPU-hours are FLOPs over its rate
    devices: dict[str, Any] = field(default_factory=default_devices)  # add one: '+plan.devices.mi355x={tflops:
    # 2500, utilisation: 0.4, memory_gb: 288}'
    sample_rows: int = setting(2000, at_least=1)  # rows of a chat file tokenized to count its tokens; the rest scaled


def check_plan(cfg, where: str) -> None:
    if cfg.device not in cfg.devices:
        raise RegraftError(f"{where}.device={cfg.device}", f"is not one of plan.devices ({', '.join(cfg.devices)})",
                           f"set {where}.device= to one of them, or add it: '+{where}.devices.{cfg.device}="
                           "{tflops: 2250, utilisation: 0.4}'")
    device = cfg.devices[cfg.device]
    tflops, utilisation, memory = device.get("tflops"), device.get("utilisation", 1.0), device.get("memory_gb")
    if (tflops is not None and not (isinstance(tflops, (int, float)) and tflops > 0)) or \
            not (isinstance(utilisation, (int, float)) and 0 < utilisation <= 1) or \
            (memory is not None and not (isinstance(memory, (int, float)) and memory > 0)):
        raise RegraftError(f"{where}.devices.{cfg.device}={dict(device)}",
                           "needs tflops > 0 (or null: measured here), 0 < utilisation <= 1 and memory_gb > 0 (or "
                           "null: not checked)", f"set {where}.devices.{cfg.device}.tflops=, .utilisation= and "
                           ".memory_gb=")


CHECKS[PlanConfig] = check_plan


@dataclass
class RaceConfig:
    """pipeline.race: the candidates and the budget of pipelines/modes/race.py (successive halving by val loss)."""

    inits: list[Init] = field(default_factory=lambda: [Init.remap, Init.realign, Init.scratch])
    lrs: list[float] = field(default_factory=lambda: [1e-3, 3e-3])
    budget_steps: int = setting(48, at_least=1)  # the full budget: optimizer steps of one candidate run to the end
    eta: int = setting(2, at_least=2)  # keep the best 1/eta at every rung
    rungs: int = setting(4, at_least=1)  # rung count, the last one at the full budget


class Verify(str, Enum):
    size = "size"  # every file present at its recorded size (a stat each)
    hash = "hash"  # and every file's sha256 as recorded (reads the whole output on every hit)
    auto = "auto"  # hash while the output is at most hash_limit_gb; above it, only files whose mtime moved


class OnMismatch(str, Enum):
    recompute = "recompute"  # the changed output is removed and the stage runs again
    stop = "stop"  # the run ends with one line naming the folder to delete


@dataclass
class CacheConfig:
    """What a cache hit is checked for before it is reused (pipelines/core/cache.py::CacheCheck)."""

    verify: Verify = Verify.auto
    hash_limit_gb: float = setting(4.0, at_least=0)
    on_mismatch: OnMismatch = OnMismatch.recompute


@dataclass
class Paths:
    outputs: str = "outputs"
    cache: str = "${paths.outputs}/cache"  # content-addressed stage outputs, shared by every run and sweep
    run: str = "${hydra:runtime.output_dir}"  # this run's summary, plots and job logs


def root_schema() -> type:
    """The root (conf/config.yaml pulls `/schema/regraft`): the inputs (target, source, data), one field per
    registered stage (pipelines/core/registry.py: its schema's defaults, a group under conf/ on top where it has
    one), and the pipeline's own settings."""
    inputs = [(name, kind, field(default=MISSING))
              for name, kind in (("target", TargetConfig), ("source", SourceConfig), ("data", DataConfig))]
    stages = [(stage.name, stage.schema, field(default_factory=stage.schema)) for stage in STAGES]
    own = [(name, kind, field(default=MISSING)) for name, kind in (("launcher", LauncherConfig),
                                                                   ("tracking", TrackingConfig))]
    own += [(name, kind, field(default_factory=kind)) for name, kind in (
        ("pipeline", PipelineSwitches), ("race", RaceConfig), ("plan", PlanConfig), ("cache", CacheConfig),
        ("paths", Paths))]
    return make_dataclass("RegraftConfig", inputs + stages + own)


RegraftConfig = root_schema()


def register_root() -> None:
    """The root rebuilt from the registry as it is now; read it as `pipelines.schema.RegraftConfig` at the time of
    use, not imported by name, so that a stage registered later is in it."""
    global RegraftConfig
    RegraftConfig = root_schema()
    register_schema("regraft", RegraftConfig)


def register_stage(stage: StageEntry) -> None:
    """A stage added from outside (a plugin's, a test's): registered after the built-in ones, its config group in
    the root from the next composition on."""
    if any(known.name == stage.name for known in STAGES):
        raise ValueError(f"a stage named {stage.name!r} is registered already")
    importlib.import_module(stage.schema_module)
    STAGES.append(stage)
    register_root()


def unregister_stage(name: str) -> None:
    STAGES[:] = [stage for stage in STAGES if stage.name != name]
    register_root()


register_schema("target", TargetConfig)
register_schema("source", SourceConfig)


def check_data(cfg, where: str) -> None:
    """Every entry a known name, a path or a set's fields (one line listing the known names otherwise)."""
    describe(cfg.train, f"{where}.train")
    check_eval_sets([describe(entry, f"{where}.eval_sets") for entry in cfg.eval_sets], f"{where}.eval_sets")


CHECKS[DataConfig] = check_data
register_schema("data", DataConfig)
register_schema("launcher", LauncherConfig)
register_schema("tracking", TrackingConfig)
register_schema("regraft", RegraftConfig)
