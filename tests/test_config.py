"""The Hydra tree: every group option composes, typos fail at composition, stages compose alone."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import pipelines.regraft  # noqa: F401  (registers every schema)
from stages.common.cli import CONF_DIR, compose_stage

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def compose_root(overrides: list[str]):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize("group, option", [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))])
def test_every_group_option_composes(group, option):
    cfg = compose_root([f"{group}={option}"])
    package = {"deepspeed": "finetune.deepspeed", "experiment": "target"}.get(group, group)  # nodes they fill
    assert OmegaConf.select(cfg, package) is not None


def test_defaults_wire_the_toy_world():
    cfg = compose_root([])
    assert (cfg.target.path, cfg.source.path, cfg.data.train) == ("@world/target_b", "@world/drafter_a",
                                                                 "@world/data_b.jsonl")
    assert cfg.vocab_map.draft_vocab_size == 1024 and cfg.remap.fallback.value == "verifier"
    assert cfg.launcher.name == "local" and cfg.tracking.uri == "sqlite:///outputs/mlflow.db"


def test_evaluate_measures_as_the_probe_does():
    cfg = compose_root(["probe.num_steps=5", "probe.backend=sglang", "probe.sglang.tp=8"])
    assert (cfg.evaluate.num_steps, cfg.evaluate.backend.value, cfg.evaluate.sglang.tp) == (5, "sglang", 8)
    assert compose_root(["evaluate.num_steps=2"]).probe.num_steps == 3


def test_the_real_case_example_composes():
    cfg = compose_root(["experiment=kimi_k25"])
    assert cfg.vocab_map.draft_vocab_size == 32000 and cfg.finetune.deepspeed.zero_stage == 2
    assert cfg.probe.backend.value == "sglang" and cfg.evaluate.sglang.tp == 8


def test_deepspeed_presets_set_the_finetune_engine():
    assert compose_root(["deepspeed=zero3"]).finetune.deepspeed.zero_stage == 3
    assert compose_root([]).finetune.deepspeed.zero_stage == 0
    with pytest.raises(ConfigCompositionException):
        compose_root(["finetune.deepspeed.zero_stag=2"])


def test_overrides_and_typos():
    assert compose_root(["remap.fallback=mean", "vocab_map.batch_size=8"]).vocab_map.batch_size == 8
    with pytest.raises(ConfigCompositionException):
        compose_root(["remap.falback=mean"])
    with pytest.raises(ConfigCompositionException):
        compose_root(["remap.fallback=nearest"])
    with pytest.raises(ConfigCompositionException):
        compose_root(["vocab_map.draft_vocab_size=many"])


@pytest.mark.parametrize("stage, inputs", [("vocab_map", {"tokenizer", "data", "out"}), ("compare", {"a", "b"}),
                                           ("remap", {"drafter", "vocab_map", "out"}), ("world", {"out"}),
                                           ("finetune", {"target", "vocab_map", "out"}),
                                           ("features", {"target", "data", "out"}),
                                           ("probe", {"target", "drafter", "out"}),
                                           ("evaluate", {"target", "drafter", "out"})])
def test_each_stage_composes_alone_and_asks_for_its_inputs(stage, inputs):
    assert OmegaConf.missing_keys(compose_stage(stage, [])) == inputs
