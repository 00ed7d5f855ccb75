"""The Hydra tree: every group option composes, typos fail at composition, stages compose alone."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import pipelines.regraft  # noqa: F401  (registers every schema)
from pipelines.core.registry import stage_names
from stages.common.contract.stage import CONF_DIR, compose_stage, stage_defaults

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")  # hydra/: Hydra's own


def compose_root(overrides: list[str]):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def leaves(node, prefix: str = "") -> dict:
    """Dotted keys and values of a plain container, interpolations left out (they resolve elsewhere)."""
    if isinstance(node, dict):
        return {key: value for name, child in node.items() for key, value in leaves(child, f"{prefix}{name}.").items()}
    if isinstance(node, str) and "${" in node:
        return {}
    return {prefix[:-1]: node}


@pytest.mark.parametrize("group, option", [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))])
def test_every_group_option_composes_and_its_values_arrive(group, option):
    path = CONF_DIR / group / f"{option}.yaml"
    header = path.read_text().splitlines()[0]
    package = header.split()[-1] if header.startswith("# @package") else group
    cfg = compose_root([f"{group}={option}"])
    written = OmegaConf.to_container(OmegaConf.load(path))
    written.pop("defaults", None)
    root = OmegaConf.to_container(cfg, enum_to_str=True)
    at = root if package == "_global_" else OmegaConf.select(OmegaConf.create(root), package)
    composed = leaves(OmegaConf.to_container(at) if OmegaConf.is_config(at) else at)
    for key, value in leaves(written).items():
        assert composed[key] == value, (group, option, key)


def test_defaults_wire_the_toy_world():
    cfg = compose_root([])
    assert (cfg.target.path, cfg.source.path, cfg.data.train) == ("@world/target_b", "@source_drafter/drafter",
                                                                 "@world/data_b.jsonl")
    assert cfg.vocab_map.draft_vocab_size == 1024 and cfg.remap.fallback.value == "verifier"
    assert cfg.launcher.name == "local" and cfg.tracking.uri == "sqlite:///outputs/mlflow.db"


def test_the_real_case_example_composes():
    cfg = compose_root(["experiment=kimi_k25"])
    assert cfg.vocab_map.draft_vocab_size == 32000 and cfg.finetune.deepspeed.zero_stage == 2
    assert cfg.probe.backend.value == "sglang" and cfg.probe.sglang.tp == 8 and cfg.source.build is None


def test_what_one_stage_takes_from_another_follows_it():
    cfg = compose_root(["finetune.loss_mask=specforge", "finetune.ttt_steps=4", "finetune.max_length=64",
                        "data.eval_sets=[{name: p, path: /p.jsonl}]"])
    assert (cfg.diagnose.loss_mask.value, cfg.diagnose.ttt_steps) == ("specforge", 4)
    assert cfg.features.max_length == 64
    assert [dict(entry) for entry in cfg.probe.eval_sets] == [{"name": "p", "path": "/p.jsonl"}]  # replaced, not merged
    real = compose_root(["experiment=kimi_k25"])  # scale=null: the stage defaults, not the toy world's sizes
    assert (real.finetune.lr, real.finetune.log_every, real.features.max_length) == (1e-4, 10, 2048)


def test_diagnose_runs_the_targets_where_and_as_the_features_stage_does():
    plain = compose_root([])
    assert plain.diagnose.backend.value == "hf" and plain.diagnose.dtype == "float32"
    engine = compose_root(["features.backend=vllm", "features.vllm.tensor_parallel_size=2", "features.dtype=bfloat16"])
    assert (engine.diagnose.backend.value, engine.diagnose.vllm.tensor_parallel_size, engine.diagnose.dtype) == \
        ("vllm", 2, "bfloat16")
    real = compose_root(["experiment=kimi_k25"])  # a 1T target: never in transformers
    assert (real.diagnose.backend.value, real.diagnose.vllm_connector, real.diagnose.vllm.python) == \
        ("vllm", "stock", real.features.vllm.python)
    parted = compose_root(["experiment=kimi_k25", "diagnose.vllm.tensor_parallel_size=4"])
    assert (parted.diagnose.vllm.tensor_parallel_size, parted.features.vllm.tensor_parallel_size) == (4, 8)


def test_deepspeed_presets_set_the_finetune_engine():
    assert compose_root(["deepspeed=zero3"]).finetune.deepspeed.zero_stage == 3
    assert compose_root([]).finetune.deepspeed.zero_stage == 0
    # a preset chooses the stage only: the pipeline's own engine settings stay whichever preset is picked
    assert {compose_root([f"deepspeed=zero{z}"]).finetune.deepspeed.warmup_ratio for z in (0, 2, 3)} == {0.05}
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
                                           ("probe", {"target", "drafter", "out"})])
def test_each_stage_composes_alone_and_asks_for_its_inputs(stage, inputs):
    assert OmegaConf.missing_keys(compose_stage(stage, [])) == inputs


@pytest.mark.parametrize("stage", stage_names())
def test_a_stages_defaults_built_without_hydra_are_what_hydra_composes(stage):
    fast, composed = stage_defaults(stage), compose_stage(stage, [])
    assert OmegaConf.to_container(fast) == OmegaConf.to_container(composed)
    assert OmegaConf.get_type(fast) is OmegaConf.get_type(composed) and OmegaConf.is_struct(fast)
    with pytest.raises(Exception):
        fast.no_such_key = 1  # a typo is refused, as in the composed one
