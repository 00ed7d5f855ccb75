"""Every stage the pipeline runs, registered once: its name, its config's schema, its code, where the DAG puts it.

The root config (pipelines/schema.py) has one field per entry, typed by its schema (`register_stage` there adds an
entry from outside, a plugin's or a test's); a job runs the entry's module on its node's config
(pipelines/core/jobs.py); the DAG (pipelines/core/dag.py) places each entry by its slot:

- `built_in`: a stage the DAG wires by name (the world, the maps, the fine-tunes, the probe): the experiment itself.
- `drafter_step`: a stage that takes a fine-tuned drafter (its config's `drafter`) and gives a drafter (its output
  folder), run after every fine-tune before that drafter is measured: phase 1, the baseline and a race's finalists,
  each in registration order. A quantizer is one; adding it is its module, its schema, one `StageEntry` below
  (and a yaml under conf/ where it has presets: docs/code.md#adding-a-stage).

The plan prices a node by its stage (pipelines/modes/estimates.py::ESTIMATORS; a stage not there is priced at no
model work) and the summary lists every node with its headline, so neither needs a line for a new stage.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum
from types import ModuleType

from stages.schemas.compare import CompareConfig
from stages.schemas.diagnose import DiagnoseConfig
from stages.schemas.features import FeaturesConfig
from stages.schemas.finetune import FinetuneConfig
from stages.schemas.probe import ProbeConfig
from stages.schemas.regenerate import RegenerateConfig
from stages.schemas.remap import RemapConfig
from stages.schemas.vocab_map import VocabMapConfig
from stages.schemas.world import WorldConfig


class Slot(str, Enum):
    built_in = "built_in"  # wired by name in pipelines/core/dag.py
    drafter_step = "drafter_step"  # drafter in, drafter out: between each fine-tune and its measurement


@dataclass(frozen=True)
class StageEntry:
    name: str  # its config group, its nodes' stage, its folder in the cache
    schema: type  # its config (registered by its schema module: `register_schema(name, schema)`)
    slot: Slot = Slot.built_in
    module: str = ""  # what a job imports and runs (`run(cfg) -> StageResult`); "": stages.<name>
    schema_module: str = ""  # what registers its schema and holds its hooks, no torch; "": stages.schemas.<name>

    def __post_init__(self) -> None:
        object.__setattr__(self, "module", self.module or f"stages.{self.name}")
        object.__setattr__(self, "schema_module", self.schema_module or f"stages.schemas.{self.name}")


STAGES: list[StageEntry] = [
    StageEntry("world", WorldConfig),
    StageEntry("regenerate", RegenerateConfig),
    StageEntry("probe", ProbeConfig),
    StageEntry("vocab_map", VocabMapConfig),
    StageEntry("compare", CompareConfig),
    StageEntry("remap", RemapConfig),
    StageEntry("diagnose", DiagnoseConfig),
    StageEntry("features", FeaturesConfig),
    StageEntry("finetune", FinetuneConfig),
]


def entry(stage: str) -> StageEntry:
    """The registered stage of that name (a KeyError names a stage nothing registered)."""
    found = next((candidate for candidate in STAGES if candidate.name == stage), None)
    if found is None:
        raise KeyError(f"no stage {stage!r} is registered (pipelines/core/registry.py STAGES)")
    return found


def stage_module(stage: str) -> ModuleType:
    return importlib.import_module(entry(stage).module)


def schema_module(stage: str) -> ModuleType:
    """The stage's config and the checks it asks of a machine: no torch, none of its code."""
    return importlib.import_module(entry(stage).schema_module)


def stage_names() -> list[str]:
    return sorted(candidate.name for candidate in STAGES)


def code_packages() -> frozenset[str]:
    """The top-level packages whose modules make up a stage's code (its cache key hashes them)."""
    return frozenset({"stages", "pipelines"} | {candidate.module.split(".")[0] for candidate in STAGES})


def drafter_steps() -> list[StageEntry]:
    return [candidate for candidate in STAGES if candidate.slot is Slot.drafter_step]
