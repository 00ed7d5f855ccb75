"""The experiment as a DAG of stage nodes, built from the composed config.

    world -> source_map -> source_drafter           (source=toy only: the built-in drafter, trained for target A)
    regenerate (pipeline.regenerate: the new target answers data.train) -> vocab_map, features, finetunes
    source drafter -> probe                          (phase 0: the source drafter on the new target, as it is)
    vocab_map (new target's data) -> compare         (the source drafter's own map vs the new one)
    vocab_map -> remap (source lm_head rows onto the new map)
    remap -> diagnose (source.target vs the new target: drift, step-0 starts, the re-aligned drafter)
    features (the new target's states, cached once) -> finetune (from remap) -> evaluate            (phase 1)
    features -> baseline_finetune (from scratch) -> baseline_evaluate                          (its baseline)
    (features.mode=online: no features node; each fine-tune asks a vLLM server for its batches' states)

A node is a stage module run on a stage config; one stage may run as several nodes (probe, evaluate and
baseline_evaluate are the probe stage; finetune, baseline_finetune and source_drafter the finetune stage). Inputs are written into that config as references: `@NODE` is the
node's output folder, `@NODE/sub/path` a path inside it (`@world/target_b`). The references give the edges, and
the cache key replaces them with the upstream keys, so a node's key is known before anything runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipelines.core.registry import drafter_steps
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import stage_defaults

# a data-parallel part is `features_3` (features.parts); a sweep's one DAG names a node that differs between
# members `finetune#2` (pipelines/sweep.py); a race's nodes carry their rate (`race_remap_lr0.001_evaluate`)
REFERENCE = re.compile(r"^@(?P<node>[a-z][a-z0-9_.-]*(?:#[0-9]+)?)(?:/(?P<sub>.*))?$")
PART = re.compile(r"(_[0-9]+)?(#[0-9]+)?$")


def base_name(name: str) -> str:
    """What a node is, without its part or sweep-member suffix: `features_3#2` -> `features`."""
    return PART.sub("", name)


@dataclass
class Node:
    name: str  # unique in the DAG (finetune, baseline_finetune, ...)
    stage: str  # the module under stages/
    config: DictConfig  # the stage's config; inputs as @references, `out` filled in at dispatch
    phase: str  # what it is for: setup, prep, 0 (the source as it is), 1 (the fine-tune), baseline, race

    @property
    def upstream(self) -> list[str]:
        return sorted({match["node"] for match in references(self.config)})


def references(config: Any) -> Iterator[re.Match]:
    """Every @reference in a config's string values."""
    container = OmegaConf.to_container(config, resolve=True, enum_to_str=True) if isinstance(config, DictConfig) \
        else config
    stack = [container]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and (match := REFERENCE.match(value)):
            yield match


def substitute(config: DictConfig, replace) -> DictConfig:
    """A copy of `config` with each @reference replaced by `replace(node, sub)`."""
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        if isinstance(value, str) and (match := REFERENCE.match(value)):
            return replace(match["node"], match["sub"])
        return value

    return OmegaConf.create(walk(OmegaConf.to_container(config, resolve=True, enum_to_str=True)))


def wired(group: DictConfig, **inputs: Any) -> DictConfig:
    """A stage's config with the pipeline's wiring, except where the user set a value."""
    config = OmegaConf.create(OmegaConf.to_container(group, resolve=True, enum_to_str=True))
    for key, value in inputs.items():
        if OmegaConf.is_missing(config, key) or config.get(key) is None:
            config[key] = value
    return config


def finetune_drafter(init: str, source: str) -> str | None:
    return {"remap": "@remap", "realign": "@diagnose/realigned", "as_is": source, "scratch": None}[init]


def finetune_node(cfg: DictConfig, name: str, init: str, phase: str, **settings: Any) -> Node:
    """A fine-tune of the new target's drafter from `init`, on the cached features (pipeline.offline) or the data;
    `settings` on top of cfg.finetune (a race's lr and stop). The pipeline's fine-tunes and every race rung."""
    cached = cached_features(cfg)
    training = {"features": "@features", "data": None} if cached else {"data": training_data(cfg)}
    config = wired(cfg.finetune, target=cfg.target.path, vocab_map="@vocab_map",
                   drafter=finetune_drafter(init, cfg.source.path), **training)
    config.merge_with({"init": init, **settings})
    if init == "scratch":  # no weights to start from, but the source's family: the baseline differs by its init only
        config.drafter = None
        config.family = config.family or given_source_family(cfg)
    if cached:
        config.data = None
    if cfg.pipeline.offline and not cached:  # features.mode=online: the states from a server (finetune.engine)
        config.engine.enabled = True
    if not config.eval_every:  # nothing measured while it trains: the probe's settings stay out of its key
        config.acceptance = stage_defaults("finetune").acceptance
    return Node(name, "finetune", config, phase)


def given_source_family(cfg: DictConfig) -> str | None:
    """The family of a source drafter given as a checkpoint (its config.json), for `source.family` left unset."""
    path = cfg.source.path
    if not path or REFERENCE.match(str(path)) or not (Path(path) / "config.json").is_file():
        return None
    from stages.common.drafter.checkpoint import DrafterCheckpoint

    return DrafterCheckpoint.open(path).config.family


def cached_features(cfg: DictConfig) -> bool:
    """Whether the fine-tunes read a features node's shards (pipeline.offline, features.mode=offline)."""
    return bool(cfg.pipeline.offline) and OmegaConf.to_container(cfg.features, enum_to_str=True)["mode"] == "offline"


def evaluate_node(cfg: DictConfig, name: str, drafter: str, phase: str) -> Node:
    """A drafter measured on the new target exactly as phase 0 measures the source one: the probe stage, its settings."""
    return Node(name, "probe", wired(cfg.probe, target=cfg.target.path, drafter=drafter), phase)


def measurement(cfg: DictConfig, name: str, drafter: str, phase: str) -> list[Node]:
    """A fine-tuned drafter measured: through every registered drafter step first (pipelines/core/registry.py, in
    order, each reading the one before), then the evaluation `name`, which reads the last step's drafter. A step's
    node is named as the evaluation with its stage for `evaluate` (`baseline_quantize` for `baseline_evaluate`)."""
    steps = []
    for step in drafter_steps():
        inputs = {"drafter": drafter, **({"target": cfg.target.path} if "target" in cfg[step.name] else {})}
        node = Node(f"{name.removesuffix('evaluate')}{step.name}", step.name, wired(cfg[step.name], **inputs), phase)
        steps.append(node)
        drafter = f"@{node.name}"
    return [*steps, evaluate_node(cfg, name, drafter, phase)]


def training_data(cfg: DictConfig) -> str:
    """What everything that trains reads: the new target's own answers under pipeline.regenerate, else data.train."""
    return "@regenerate/regenerated.jsonl" if cfg.pipeline.regenerate else cfg.data.train


def source_nodes(build: DictConfig) -> list[Node]:
    """The built-in source drafter, made by regraft's own stages: a draft vocab counted on target A's data, then a
    from-scratch fine-tune on target A (the finetune stage's defaults plus `source.build.finetune`)."""
    counted = wired(stage_defaults("vocab_map"), tokenizer=build.target, data=build.data)
    counted.draft_vocab_size = build.draft_vocab_size
    settings = {**OmegaConf.to_container(build.finetune, resolve=True), "family": build.family}
    trained = wired(built_finetune(settings), target=build.target, data=build.data, vocab_map="@source_map")
    return [Node("source_map", "vocab_map", counted, "setup"), Node("source_drafter", "finetune", trained, "setup")]


def built_finetune(settings: dict[str, Any]) -> DictConfig:
    """The finetune stage's defaults with `settings` on top, checked against its schema: a key it has not or a value
    of the wrong type raises OmegaConf's error, keyed as source.build.finetune.<key> (pipelines/config_errors.py
    says it as a composition error)."""
    config = stage_defaults("finetune")
    try:
        config.merge_with({**settings, "init": "scratch"})
    except OmegaConfBaseException as error:
        error.full_key = f"source.build.finetune.{error.full_key}"  # named where it is set: the command says it
        raise
    return config


@dataclass(frozen=True)
class Measured:
    """A fine-tune the run makes and the evaluation of its drafter (measured as phase 0 is), by node name."""
    train: str
    evaluate: str
    phase: str
    label: str  # how the summary's plots name it


# The nodes other modules read by role (the summary, the race); every other name is only built here
PROBE, COMPARE, DIAGNOSE = "probe", "compare", "diagnose"
PHASE1 = Measured("finetune", "evaluate", "1", "remap + fine-tune")  # from finetune.init
BASELINE = Measured("baseline_finetune", "baseline_evaluate", "baseline", "from scratch")


def build_nodes(cfg: DictConfig) -> list[Node]:
    """The pipeline's nodes in a topological order, only those `cfg.pipeline` switches on."""
    target, source, data = cfg.target.path, cfg.source.path, training_data(cfg)
    world = OmegaConf.create(OmegaConf.to_container(cfg.world, resolve=True, enum_to_str=True))
    nodes = [Node("world", "world", world, "setup")]
    if cfg.source.build is not None:
        nodes += source_nodes(cfg.source.build)
    if cfg.pipeline.regenerate:  # the new target's own answers replace the data's for everything that trains
        nodes += data_parallel("regenerate", wired(cfg.regenerate, target=target, data=cfg.data.train), "prep")
    if cfg.pipeline.probe:
        nodes.append(evaluate_node(cfg, PROBE, source, "0"))
    nodes += data_parallel("vocab_map", wired(cfg.vocab_map, tokenizer=target, data=data), "prep")
    nodes.append(Node(COMPARE, "compare", wired(cfg.compare, a=source, b="@vocab_map"), "prep"))
    nodes.append(Node("remap", "remap", wired(cfg.remap, drafter=source, vocab_map="@vocab_map", verifier=target),
                      "prep"))
    init = OmegaConf.to_container(cfg.finetune, enum_to_str=True)["init"]
    if cfg.pipeline.diagnose or init == "realign":  # realign's drafter is the one diagnose re-aligns
        built_here = cfg.source.build is not None and str(source).startswith("@source_drafter")
        old_target = cfg.source.target or (cfg.source.build.target if built_here else None)
        nodes.append(Node(DIAGNOSE, "diagnose", wired(cfg.diagnose, drafter="@remap", target=target, data=data,
                                                        target_a=old_target, vocab_map="@vocab_map"), "prep"))
    if cached_features(cfg):
        nodes += data_parallel("features", wired(cfg.features, target=target, data=data, drafter=source), "prep")
    runs = [(PHASE1, init)] + ([(BASELINE, "scratch")] if cfg.pipeline.baseline else [])
    for run, run_init in runs:
        nodes.append(finetune_node(cfg, run.train, run_init, run.phase))
        if cfg.pipeline.evaluate:  # phase 1 is measured exactly as phase 0, by the same stage and settings
            nodes += measurement(cfg, run.evaluate, f"@{run.train}", run.phase)
    for node in nodes:
        if node.phase != "setup":
            mark_new_target(node, cfg.target)
    return without_unused_setup(nodes)


def mark_new_target(node: Node, target: DictConfig) -> None:
    """Every node past setup runs on the new target: its remote code (in the stage, and in the server an online
    fine-tune starts), and its name in the drafters they write."""
    for config in (node.config, node.config.get("engine")):
        if config is not None and "trust_remote_code" in config:
            config.trust_remote_code = config.trust_remote_code or target.trust_remote_code
    for key in ("target_name", "verifier_name"):
        if key in node.config:
            node.config[key] = target.name


def data_parallel(name: str, config: DictConfig, phase: str) -> list[Node]:
    """One node, or `parts` part nodes (`name_0`, ...: each a job and a complete cached output of its own) and the
    node that joins them (`name`, reading the part outputs in order), which is what downstream nodes read."""
    if config.parts == 1:
        return [Node(name, name, config, phase)]
    parts = []
    for index in range(config.parts):
        part = config.copy()
        part.part = index
        parts.append(Node(f"{name}_{index}", name, part, phase))
    join = config.copy()
    join.part_outputs = [f"@{part.name}" for part in parts]
    return [*parts, Node(name, name, join, phase)]


SETUP = ("world", "source_map", "source_drafter")  # built only when a later node reads them


def without_unused_setup(nodes: list[Node]) -> list[Node]:
    while True:
        used = {match["node"] for node in nodes for match in references(node.config)}
        kept = [node for node in nodes if node.name not in SETUP or node.name in used]
        if len(kept) == len(nodes):
            return kept
        nodes = kept


def check_graph(nodes: list[Node], done: set[str] | None = None) -> None:
    """Every reference names an earlier node (or one in `done`, run before)."""
    seen: set[str] = set(done or ())
    for node in nodes:
        for upstream in node.upstream:
            if upstream not in seen:
                raise RegraftError(None, f"{node.name} refers to @{upstream}, which is not an earlier stage",
                                   "check the @references in the pipeline config")
        seen.add(node.name)


def resolve(config: DictConfig, outputs: dict[str, Path]) -> DictConfig:
    """References replaced by the upstream nodes' output folders."""
    return substitute(config, lambda node, sub: str(outputs[node] / sub) if sub else str(outputs[node]))
