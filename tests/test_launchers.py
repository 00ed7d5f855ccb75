"""The resources a node's job gets (pipelines/launchers.py::Launcher.resources): `launcher.per_stage.<stage>` for
every node of the stage, `launcher.per_node.<name>` over it; a per_stage key that is not a stage is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import pipelines.regraft  # noqa: F401  (registers every schema, for compose)
from pipelines.dag import Node, build_nodes
from pipelines.launchers import LocalLauncher, SlurmLauncher, make_launcher
from pipelines.race import Candidate, rung_node
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import CONF_DIR


def composed(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["launcher=slurm", *overrides])


def node(name: str, stage: str, **config) -> Node:
    return Node(name, stage, OmegaConf.create(config), "prep")


def launcher(**cfg) -> SlurmLauncher:
    return SlurmLauncher(OmegaConf.create({"name": "slurm", "poll_s": 1.0, **cfg}), Path("unused"))


def test_per_stage_reaches_every_node_of_the_stage_and_per_node_goes_over_it():
    slurm = launcher(resources={"timeout_min": 10, "cpus_per_task": 1},
                     per_stage={"finetune": {"timeout_min": 20, "tasks_per_node": 2}, "probe": {"timeout_min": 30},
                                "features": {"cpus_per_task": 4}},
                     per_node={"evaluate": {"timeout_min": 40}, "source_drafter": {"tasks_per_node": 1},
                               "features": {"mem_gb": 8}, "features_2": {"mem_gb": 16}})
    got = lambda name, stage, key: slurm.resources(node(name, stage))[key]  # noqa: E731
    for name in ("finetune", "baseline_finetune", "race_remap_lr0.001_step6", "race_scratch_lr0.003", "finetune#2"):
        assert (got(name, "finetune", "timeout_min"), got(name, "finetune", "tasks_per_node")) == (20, 2), name
    assert got("source_drafter", "finetune", "tasks_per_node") == 1 and got("source_drafter", "finetune",
                                                                           "timeout_min") == 20
    for name in ("probe", "baseline_evaluate", "race_scratch_lr0.003_evaluate"):
        assert got(name, "probe", "timeout_min") == 30, name
    assert got("evaluate", "probe", "timeout_min") == got("evaluate#1", "probe", "timeout_min") == 40
    assert got("world", "world", "timeout_min") == 10 and got("world", "world", "cpus_per_task") == 1
    # a part is its node (`features`) unless named itself; the exact name wins
    assert [got(name, "features", "mem_gb") for name in ("features", "features_0", "features_2", "features_2#1")] == \
        [8, 8, 16, 16]
    assert got("features_1", "features", "cpus_per_task") == 4


def test_the_shipped_slurm_settings_give_a_race_with_two_ranks_two_tasks_a_rung():
    cfg = composed("finetune.nproc=2", "finetune.spawn=torchrun", "pipeline.race=true")
    slurm = SlurmLauncher(cfg.launcher, Path("unused"))
    rung = rung_node(cfg, Candidate("remap", 1e-3), 6, "unused")
    assert rung.stage == "finetune" and rung.config.nproc == 2
    assert slurm.tasks(rung) == 2 and slurm.resources(rung)["gpus_per_node"] == 2
    slurm.check(rung, OmegaConf.to_container(rung.config))  # the layout agrees with the rung's nproc
    nodes = {n.name: n for n in build_nodes(cfg)}
    assert slurm.tasks(nodes["source_drafter"]) == 1  # one rank whatever finetune.nproc says: its own config
    slurm.check(nodes["source_drafter"], OmegaConf.to_container(nodes["source_drafter"].config, resolve=True))
    assert slurm.resources(nodes["source_drafter"])["timeout_min"] == slurm.resources(nodes["finetune"])["timeout_min"]
    evaluate = Node("race_scratch_lr0.001_evaluate", "probe", cfg.probe, "race")
    assert slurm.resources(evaluate) == slurm.resources(nodes["probe"])


def test_the_kimi_experiment_gives_both_fine_tunes_its_time():
    cfg = composed("experiment=kimi_k25")
    slurm = SlurmLauncher(cfg.launcher, Path("unused"))
    assert {slurm.resources(node(name, "finetune"))["timeout_min"] for name in
            ("finetune", "baseline_finetune", "race_remap_lr0.0001_step12")} == {2880}


def test_a_node_name_under_per_stage_is_refused_before_any_work():
    says = (r"launcher.per_stage.evaluate: evaluate is not a stage \(the stages: compare, diagnose, .*\); "
            r".* \(fix: for the node named evaluate alone use launcher.per_node.evaluate\)")
    with pytest.raises(RegraftError, match=says):
        make_launcher(composed("+launcher.per_stage.evaluate={timeout_min: 60}").launcher, Path("unused"))
    with pytest.raises(RegraftError, match="features_2 is not a stage"):
        LocalLauncher(OmegaConf.create({"name": "local", "per_stage": {"features_2": {}}}), Path("unused"))
    composed("+launcher.per_node.evaluate.timeout_min=60", "+launcher.per_stage.probe.timeout_min=30")  # both fine


def test_a_one_task_stage_given_more_names_the_setting_that_gave_them():
    plain = OmegaConf.create({"out": "x"})
    cases = [({"per_node": {"compare": {"tasks_per_node": 2}}}, r"set launcher.per_node.compare.tasks_per_node=1\)"),
             ({"per_stage": {"compare": {"nodes": 2}}}, r"set launcher.per_stage.compare.nodes=1\)"),
             ({"resources": {"tasks_per_node": 2, "nodes": 2}},
              r"set launcher.per_node.compare.tasks_per_node=1 and launcher.per_node.compare.nodes=1\)")]
    for cfg, says in cases:
        with pytest.raises(RegraftError, match=r"compare runs as one task, the launcher gives it \d .*" + says):
            launcher(**cfg).submit(node("compare", "compare"), plain, [])
