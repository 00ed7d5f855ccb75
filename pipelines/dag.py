"""The experiment as a DAG of stage nodes, built from the composed config.

    world -> source_map -> source_drafter           (source=toy only: the built-in drafter, trained for target A)
    regenerate (pipeline.regenerate: the new target answers data.train) -> vocab_map, features, finetunes
    source drafter -> probe                          (phase 0: the source drafter on the new target, as it is)
    vocab_map (new target's data) -> compare         (the source drafter's own map vs the new one)
    vocab_map -> remap (source lm_head rows onto the new map)
    remap -> diagnose (source.target vs the new target: drift, step-0 starts, the re-aligned drafter)
    features (the new target's states, cached once) -> finetune (from remap) -> evaluate            (phase 1)
    features -> baseline_finetune (from scratch) -> baseline_evaluate                          (its baseline)

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

from stages.common.errors import RegraftError
from stages.common.stage import compose_stage

# a data-parallel part is `features_3` (features.shards); a sweep's one DAG names a node that differs between
# members `finetune#2` (pipelines/sweep.py)
REFERENCE = re.compile(r"^@(?P<node>[a-z_]+(?:_[0-9]+)?(?:#[0-9]+)?)(?:/(?P<sub>.*))?$")
PART = re.compile(r"(_[0-9]+)?(#[0-9]+)?$")


def base_name(name: str) -> str:
    """What a node is, without its part or sweep-member suffix: `features_3#2` -> `features`."""
    return PART.sub("", name)
PHASES = {"world": "setup", "source_map": "setup", "source_drafter": "setup", "regenerate": "prep", "diagnose": "prep", "probe": "0",
          "vocab_map": "prep", "compare": "prep", "remap": "prep", "features": "prep", "finetune": "1", "evaluate": "1",
          "baseline_finetune": "baseline", "baseline_evaluate": "baseline"}


@dataclass
class Node:
    name: str  # unique in the DAG (finetune, baseline_finetune, ...)
    stage: str  # the module under stages/
    config: DictConfig  # the stage's config; inputs as @references, `out` filled in at dispatch

    @property
    def phase(self) -> str:
        return PHASES.get(base_name(self.name), "race")  # a race's rung nodes are named by their candidates

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


def source_nodes(build: DictConfig) -> list[Node]:
    """The built-in source drafter, made by regraft's own stages: a draft vocab counted on target A's data, then a
    from-scratch fine-tune on target A (stage defaults plus `source.build`, never the pipeline's finetune options)."""
    counted = wired(compose_stage("vocab_map", []), tokenizer=build.target, data=build.data)
    counted.draft_vocab_size = build.draft_vocab_size
    trained = wired(compose_stage("finetune", []), target=build.target, data=build.data, vocab_map="@source_map")
    trained.merge_with({"init": "scratch", "seed": build.seed, "ttt_steps": build.ttt_steps, "lr": build.lr,
                        "max_steps": build.steps, "epochs": build.steps,  # max_steps ends it, epoch ends validate
                        "micro_batch_size": build.micro_batch_size, "max_length": build.max_length,
                        "val_fraction": build.val_fraction, "checkpoint_every": build.steps})
    return [Node("source_map", "vocab_map", counted), Node("source_drafter", "finetune", trained)]


def build_nodes(cfg: DictConfig) -> list[Node]:
    """The pipeline's nodes in a topological order, only those `cfg.pipeline` switches on."""
    target, source, data = cfg.target.path, cfg.source.path, cfg.data.train
    nodes = [Node("world", "world", OmegaConf.create(OmegaConf.to_container(cfg.world, resolve=True, enum_to_str=True)))]
    if cfg.source.build is not None:
        nodes += source_nodes(cfg.source.build)
    if cfg.pipeline.regenerate:  # the new target's own answers replace the data's for everything that trains
        nodes += data_parallel("regenerate", wired(cfg.regenerate, target=target, data=data))
        data = "@regenerate/regenerated.jsonl"
    if cfg.pipeline.probe:
        nodes.append(Node("probe", "probe", wired(cfg.probe, target=target, drafter=source)))
    nodes += data_parallel("vocab_map", wired(cfg.vocab_map, tokenizer=target, data=data))
    nodes.append(Node("compare", "compare", wired(cfg.compare, a=source, b="@vocab_map")))
    nodes.append(Node("remap", "remap", wired(cfg.remap, drafter=source, vocab_map="@vocab_map", verifier=target)))
    init = OmegaConf.to_container(cfg.finetune, enum_to_str=True)["init"]
    if cfg.pipeline.diagnose or init == "realign":  # realign's drafter is the one diagnose re-aligns
        built_here = cfg.source.build is not None and str(source).startswith("@source_drafter")
        old_target = cfg.source.target or (cfg.source.build.target if built_here else None)
        nodes.append(Node("diagnose", "diagnose", wired(cfg.diagnose, drafter="@remap", target=target, data=data,
                                                        target_a=old_target, vocab_map="@vocab_map")))
    training = {"data": data}
    if cfg.pipeline.offline:
        nodes += data_parallel("features", wired(cfg.features, target=target, data=data, drafter=source))
        training = {"features": "@features", "data": None}
    runs = [("finetune", "evaluate", init)]
    if cfg.pipeline.baseline:
        runs.append(("baseline_finetune", "baseline_evaluate", "scratch"))
    for train_name, eval_name, init in runs:
        finetune = wired(cfg.finetune, target=target, vocab_map="@vocab_map",
                         drafter=finetune_drafter(init, source), **training)
        finetune.init = init
        if init == "scratch":
            finetune.drafter = None
        if cfg.pipeline.offline:
            finetune.data = None
        nodes.append(Node(train_name, "finetune", finetune))
        if cfg.pipeline.evaluate:  # phase 1 is measured exactly as phase 0, by the same stage and settings
            nodes.append(Node(eval_name, "probe", wired(cfg.probe, target=target, drafter=f"@{train_name}")))
    for node in nodes:
        if "trust_remote_code" in node.config and not node.name.startswith("source_"):
            node.config.trust_remote_code = node.config.trust_remote_code or cfg.target.trust_remote_code
        for key in ("target_name", "verifier_name"):  # the nodes that record the new target in a drafter
            if key in node.config and not node.name.startswith("source_"):
                node.config[key] = cfg.target.name
    return without_unused_setup(nodes)


def data_parallel(name: str, config: DictConfig) -> list[Node]:
    """One node, or `shards` part nodes (`name_0`, ...: each a job and a complete cached output of its own) and the
    node that joins them (`name`, reading the parts in order), which is what downstream nodes read."""
    if config.shards == 1:
        return [Node(name, name, config)]
    parts = []
    for shard in range(config.shards):
        part = config.copy()
        part.shard = shard
        parts.append(Node(f"{name}_{shard}", name, part))
    join = config.copy()
    join.parts = [f"@{part.name}" for part in parts]
    return [*parts, Node(name, name, join)]


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
