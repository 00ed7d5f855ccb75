"""A stage is registered once (pipelines/core/registry.py): the root config, the DAG, the race's measurements and
the jobs read the registry, so a stage added there runs where its slot puts it, with its config group in the root."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipelines.core.dag import build_nodes, check_graph, measurement
from pipelines.core.registry import STAGES, Slot, StageEntry, stage_names
from pipelines.schema import register_stage, unregister_stage


def compose(outputs: Path, *overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import pipelines.regraft  # noqa: F401  (registers every schema, for compose)
    from stages.common.contract.stage import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=[f"paths.outputs={outputs}", f"paths.run={outputs / 'run'}",
                                                  "launcher=inline", "debug=tiny", "tracking.enabled=false",
                                                  *overrides])


@pytest.fixture
def stamp():
    from tests.stamp_stage import StampConfig

    register_stage(StageEntry("stamp", StampConfig, Slot.drafter_step, module="tests.stamp_stage",
                              schema_module="tests.stamp_stage"))
    yield
    unregister_stage("stamp")


def test_every_stage_module_is_registered_once():
    on_disk = sorted(path.stem if path.suffix == ".py" else path.name
                     for path in (Path(__file__).parents[1] / "stages").iterdir()
                     if path.name not in ("__init__.py", "__pycache__", "common", "schemas"))
    assert stage_names() == on_disk
    assert all(stage.slot is Slot.built_in for stage in STAGES)


def test_without_a_drafter_step_each_evaluation_reads_its_fine_tune(tmp_path):
    nodes = {node.name: node for node in build_nodes(compose(tmp_path))}
    assert nodes["evaluate"].config.drafter == "@finetune"
    assert nodes["baseline_evaluate"].config.drafter == "@baseline_finetune"


def test_a_drafter_step_sits_between_every_fine_tune_and_its_evaluation(stamp, tmp_path):
    nodes = {node.name: node for node in build_nodes(compose(tmp_path, "stamp.note=hello"))}
    assert nodes["stamp"].config.drafter == "@finetune" and nodes["stamp"].config.note == "hello"
    assert nodes["evaluate"].config.drafter == "@stamp"
    assert nodes["baseline_stamp"].config.drafter == "@baseline_finetune"
    assert nodes["baseline_evaluate"].config.drafter == "@baseline_stamp"
    assert nodes["stamp"].phase == "1" and nodes["baseline_stamp"].phase == "baseline"
    # a race finalist's measurement: its drafter a finished fine-tune's folder, its names carrying the rate
    finalist = measurement(compose(tmp_path), "race_remap_lr0.001_evaluate", "/cache/finetune/abc", "race")
    assert [node.name for node in finalist] == ["race_remap_lr0.001_stamp", "race_remap_lr0.001_evaluate"]
    assert finalist[0].config.drafter == "/cache/finetune/abc"
    assert finalist[1].upstream == ["race_remap_lr0.001_stamp", "world"]  # world: the new target
    check_graph(finalist, done={"world"})


def test_the_root_check_holds_a_registered_stage_to_its_bounds(stamp, tmp_path):
    import pipelines.schema
    from stages.common.contract.errors import RegraftError
    from stages.common.contract.stage import check_config

    check_config(compose(tmp_path), pipelines.schema.RegraftConfig, "")
    with pytest.raises(RegraftError, match=r"stamp.copies=0: must be >= 1"):
        check_config(compose(tmp_path, "stamp.copies=0"), pipelines.schema.RegraftConfig, "")


def test_an_unknown_stage_group_is_refused_until_registered(tmp_path):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="stamp"):
        compose(tmp_path, "stamp.note=hello")


@pytest.mark.slow
def test_a_registered_stage_runs_in_the_tiny_pipeline(stamp, tmp_path):
    from rich.console import Console

    from pipelines.pipeline import run_pipeline

    cfg = compose(tmp_path, "stamp.note=hello")
    results = run_pipeline(cfg, tmp_path / "run", ["stamp.note=hello"], Console(quiet=True)).results
    for step, evaluation in (("stamp", "evaluate"), ("baseline_stamp", "baseline_evaluate")):
        stamped = Path(results[step].out)
        assert json.loads((stamped / "stamp.json").read_text()) == {"note": "hello"}
        trained = Path(results[step.replace("stamp", "finetune")].out) / "drafter" / "model.safetensors"
        assert (stamped / "drafter" / "model.safetensors").read_bytes() == trained.read_bytes()
        assert results[step].headline == "stamped: hello"
        manifest = json.loads((Path(results[evaluation].out) / "manifest.json").read_text())
        assert manifest["config"]["drafter"] == str(stamped)  # evaluate measured the stamped drafter
        assert results[evaluation].metrics["accept_len"] >= 1.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {"stamp", "baseline_stamp"} <= set(summary["stages"])
    assert OmegaConf.select(cfg, "stamp.note") == "hello"
