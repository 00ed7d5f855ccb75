"""The resources a node's job gets (pipelines/launch/base.py::Launcher.resources): what its stage holds (GPUs, ranks)
over `launcher.resources`, `launcher.per_stage.<stage>` for every node of the stage over that,
`launcher.per_node.<name>` over it; a per_stage key that is not a stage is refused; GPUs a node lacks are refused
before any work; Slurm is asked for them, and the local launcher runs jobs side by side only on GPUs no other job
holds (CUDA_VISIBLE_DEVICES)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import pipelines.regraft  # noqa: F401  (registers every schema, for compose)
from pipelines.core.dag import Node, build_nodes
from pipelines.launch.local import LocalLauncher
from pipelines.launch.make import make_launcher
from pipelines.launch.slurm import SlurmLauncher
from pipelines.modes.race import Candidate, rung_node
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
    cfg = composed("finetune.nproc=2", "finetune.spawn=torchrun", "pipeline.race=true", "launcher.node_gpus=2")
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
    composed("+launcher.per_node.evaluate.timeout_min=60", "launcher.per_stage.probe.timeout_min=30")  # both fine


def test_a_one_task_stage_given_more_names_the_setting_that_gave_them():
    plain = OmegaConf.create({"out": "x"})
    cases = [({"per_node": {"compare": {"tasks_per_node": 2}}}, r"set launcher.per_node.compare.tasks_per_node=1\)"),
             ({"per_stage": {"compare": {"nodes": 2}}}, r"set launcher.per_stage.compare.nodes=1\)"),
             ({"resources": {"tasks_per_node": 2, "nodes": 2}},
              r"set launcher.per_node.compare.tasks_per_node=1 and launcher.per_node.compare.nodes=1\)")]
    for cfg, says in cases:
        with pytest.raises(RegraftError, match=r"compare runs as one task, the launcher gives it \d .*" + says):
            launcher(**cfg).submit(node("compare", "compare"), plain, [])


ENGINE_NODES = ("features", "probe", "evaluate", "baseline_evaluate")
FINETUNES = ("finetune", "baseline_finetune")


def kimi_nodes(*overrides: str) -> tuple[SlurmLauncher, dict[str, Node]]:
    """The experiment's nodes as a run builds them: its named data sets settled to paths first (fetching nothing)."""
    from pipelines.core.data_sets import settle_data

    cfg = composed("experiment=kimi_k25", *overrides)
    settle_data(cfg, fetch=False)
    return SlurmLauncher(cfg.launcher, Path("unused")), {n.name: n for n in build_nodes(cfg)}


def resolved(node: Node) -> dict:
    return OmegaConf.to_container(node.config, resolve=True, enum_to_str=True)


def shape(resources: dict) -> tuple:
    return resources["nodes"] if "nodes" in resources else 1, resources["tasks_per_node"], resources["gpus_per_node"]


def test_on_slurm_each_engine_stage_asks_for_its_gpus_and_each_fine_tune_for_its_ranks():
    slurm, nodes = kimi_nodes()  # launcher.node_gpus: 8, the experiment's node
    for name in ENGINE_NODES:
        assert shape(slurm.resources(nodes[name])) == (1, 1, 8), name
        slurm.check(nodes[name], resolved(nodes[name]))
    for name in FINETUNES:
        assert shape(slurm.resources(nodes[name])) == (1, 8, 8), name
        slurm.check(nodes[name], resolved(nodes[name]))
    # regenerate starts its own SGLang server on the node (regenerate.serve), diagnose runs the targets on vLLM
    for name in ("regenerate", "diagnose"):
        assert shape(slurm.resources(nodes[name])) == (1, 1, 8), name
    for name in ("vocab_map", "remap"):
        assert shape(slurm.resources(nodes[name])) == (1, 1, 0), name
    assert slurm.resources(nodes["features"])["cpus_per_task"] == 16  # the engine stages' own CPUs and time
    assert slurm.resources(nodes["probe"])["timeout_min"] == 480 and slurm.resources(nodes["finetune"])[
        "timeout_min"] == 2880


def test_on_cpu_nodes_no_stage_asks_for_a_gpu_and_the_fine_tunes_keep_their_ranks():
    slurm, nodes = kimi_nodes("launcher.node_gpus=0")
    for name in (*ENGINE_NODES, *FINETUNES):
        assert shape(slurm.resources(nodes[name]))[2] == 0, name
    assert shape(slurm.resources(nodes["finetune"])) == (1, 8, 0)


def test_per_stage_and_per_node_go_over_what_a_stage_holds_and_resources_under_it():
    slurm, nodes = kimi_nodes("launcher.resources.gpus_per_node=1", "+launcher.per_stage.features.gpus_per_node=8",
                              "+launcher.per_node.evaluate.mem_gb=900", "launcher.per_stage.probe.cpus_per_task=32")
    assert slurm.resources(nodes["vocab_map"])["gpus_per_node"] == 1  # holds none: resources' own
    assert slurm.resources(nodes["probe"])["gpus_per_node"] == 8  # holds 8: over resources
    assert slurm.resources(nodes["evaluate"])["mem_gb"] == 900 and slurm.resources(nodes["evaluate"])[
        "cpus_per_task"] == 32
    assert slurm.setting_of(nodes["probe"], "gpus_per_node") == "launcher.per_node.probe.gpus_per_node"  # held
    assert slurm.setting_of(nodes["features"], "gpus_per_node") == "launcher.per_stage.features.gpus_per_node"


def test_a_stage_that_holds_more_gpus_than_a_node_has_is_refused_before_any_work():
    slurm, nodes = kimi_nodes("launcher.node_gpus=4")
    says = (r"^launcher.node_gpus=4: features holds 1 node\(s\) x 1 task\(s\), 8 GPU\(s\) a node, serving vLLM, "
            r"tensor-parallel 8, but a node has 4 GPU\(s\) \(launcher.node_gpus\) \(fix: lower the stage's "
            r"tensor-parallel size or ranks to 4, or run it where a node has 8 \(launcher.node_gpus=8\)\)$")
    with pytest.raises(RegraftError, match=says):
        slurm.check(nodes["features"], resolved(nodes["features"]))
    slurm, nodes = kimi_nodes("launcher.node_gpus=4", "probe.sglang.tp=4", "features.vllm.tensor_parallel_size=4",
                              "finetune.nproc=4")
    for name in (*ENGINE_NODES, *FINETUNES):
        slurm.check(nodes[name], resolved(nodes[name]))


def test_an_unknown_gpu_count_refuses_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo: node_gpus not known, taken as 0
    cfg = composed("finetune.device=cuda", "finetune.nproc=2", "finetune.spawn=torchrun")
    slurm, nodes = SlurmLauncher(cfg.launcher, Path("unused")), {n.name: n for n in build_nodes(cfg)}
    assert not slurm.node_gpus().known and shape(slurm.resources(nodes["finetune"])) == (1, 2, 2)
    slurm.check(nodes["finetune"], resolved(nodes["finetune"]))
    local = LocalLauncher(OmegaConf.merge(cfg.launcher, {"name": "local", "node_gpus": 0}), Path("unused"))
    with pytest.raises(RegraftError, match=r"^launcher.node_gpus=0: finetune holds 1 node\(s\) x 2 task\(s\), 2 GPU.* "
                                           r"\(fix: let the stage compute on the CPU \(its device\), or run it where a "
                                           r"node has 2 \(launcher.node_gpus=2\)\)$"):
        local.check_gpus(nodes["finetune"])  # set: known, so refused


def test_a_per_stage_gpu_count_is_refused_above_a_node_and_below_what_the_stage_holds():
    slurm, nodes = kimi_nodes("+launcher.per_stage.probe.gpus_per_node=16")
    with pytest.raises(RegraftError, match=r"^launcher.per_stage.probe.gpus_per_node=16: asks for more GPUs than a "
                                           r"node has \(8: launcher.node_gpus\) \(fix: set it to at most 8"):
        slurm.check(nodes["evaluate"], resolved(nodes["evaluate"]))
    slurm, nodes = kimi_nodes("+launcher.per_node.features.gpus_per_node=1")
    with pytest.raises(RegraftError, match=r"^launcher.per_node.features.gpus_per_node=1: features holds .* 8 GPU\(s\) "
                                           r"a node, serving vLLM, tensor-parallel 8 \(fix: set it to 8, or drop it\)"):
        slurm.check(nodes["features"], resolved(nodes["features"]))
    slurm, nodes = kimi_nodes("+launcher.per_stage.vocab_map.gpus_per_node=2")  # more than it holds, within a node
    slurm.check(nodes["vocab_map"], resolved(nodes["vocab_map"]))
    assert slurm.resources(nodes["vocab_map"])["gpus_per_node"] == 2


def test_a_local_node_gpus_this_machine_does_not_show_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    local = LocalLauncher(OmegaConf.create({"name": "local", "node_gpus": 2}), Path("unused"))
    with pytest.raises(RegraftError, match=r"^launcher.node_gpus=2: this machine shows 1 GPU\(s\) "
                                           r"\(CUDA_VISIBLE_DEVICES\) \(fix: set launcher.node_gpus=null"):
        local.check_machine(planning=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    LocalLauncher(OmegaConf.create({"name": "local", "node_gpus": 2}), Path("unused")).check_machine(planning=False)


def test_slurm_without_its_commands_is_refused_for_a_run_not_for_a_plan(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    slurm = launcher(node_gpus=8)
    slurm.check_machine(planning=True)
    with pytest.raises(RegraftError, match=r"^launcher=slurm: Slurm's commands are not on this machine \(sbatch, "
                                           r"squeue, scontrol, scancel not on PATH\) \(fix: run regraft on a login"):
        slurm.check_machine(planning=False)
    for command in ("sbatch", "squeue", "scontrol", "scancel"):
        (tmp_path / command).symlink_to("/bin/true")
    slurm.check_machine(planning=False)


class Recording(LocalLauncher):
    """The local launcher with its jobs running tests/gpu_jobs.py::record in place of their stage."""

    def function(self, node):
        from tests.gpu_jobs import record

        return record


def engine(name: str, stage: str, gpus: int, folder: Path, *meet: str) -> Node:
    """A node whose stage holds `gpus` on a GPU node: features or probe on vLLM at that tensor-parallel size."""
    return node(name, stage, backend="vllm", vllm={"tensor_parallel_size": gpus}, job=name, record=str(folder),
                meet=list(meet))


def run_recorded(nodes: list[Node], folder: Path, warm: bool, max_parallel: int | None = None) -> dict[str, dict]:
    from rich.console import Console

    from pipelines.core.runner import run_dag

    local = Recording(OmegaConf.create({"name": "local", "warm": warm}), folder / "jobs")
    local.prepare(nodes)
    assert local.warm is None if not warm else local.warm.alive()
    run_dag(nodes, folder / "cache", local, None, Console(quiet=True), poll_s=0.05, max_parallel=max_parallel)
    return {n.name: json.loads((folder / f"{n.name}.json").read_text()) for n in nodes}


@pytest.mark.parametrize("warm", [False, True], ids=["plain", "warm"])
def test_local_jobs_run_side_by_side_only_on_gpus_no_other_job_holds(tmp_path, monkeypatch, warm):
    """A node of two GPUs: two 1-GPU jobs run together (each waits for the other to start), each on its own GPU;
    two 2-GPU jobs run one after the other, on both; a CPU job runs beside a GPU job and sees no GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what a scheduler would give regraft: this node's GPUs
    nodes = [engine("a", "features", 1, tmp_path, "b"), engine("b", "features", 1, tmp_path, "a"),
             engine("c", "probe", 2, tmp_path, "e"), engine("d", "probe", 2, tmp_path),
             node("e", "vocab_map", job="e", record=str(tmp_path), meet=["c"])]
    seen = run_recorded(nodes, tmp_path, warm)
    assert {seen["a"]["gpus"], seen["b"]["gpus"]} == {"0", "1"}  # disjoint, at the same time
    assert seen["c"]["gpus"] == seen["d"]["gpus"] == "0,1" and seen["e"]["gpus"] == ""
    assert seen["c"]["start"] > max(seen["a"]["end"], seen["b"]["end"])  # it waited for both GPUs
    assert seen["d"]["start"] > seen["c"]["end"] or seen["c"]["start"] > seen["d"]["end"]  # never together


class Ended:
    """A job as the pool sees it."""

    def __init__(self, ended: bool):
        self.ended = ended

    def done(self) -> bool:
        return self.ended


def test_a_gpu_job_may_start_only_on_free_gpus_and_per_node_can_reserve_a_servers(monkeypatch):
    """A stage that holds no GPU may start whatever runs; `per_node.<name>.gpus_per_node` makes a job hold GPUs its
    stage does not (a server it asks at a URL, running on this node's GPUs)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    local = LocalLauncher(OmegaConf.create({"name": "local", "per_node": {"regenerate": {"gpus_per_node": 2}}}),
                          Path("unused"))
    regenerate, vocab, probe = node("regenerate", "regenerate", engine="openai"), node("vocab_map", "vocab_map"), \
        node("probe", "probe", backend="vllm", vllm={"tensor_parallel_size": 1})
    assert [local.gpus_asked(n) for n in (regenerate, vocab, probe)] == [2, 0, 1]
    busy = Ended(False)
    local.gpu_pool().hold(busy, ("1",))
    assert [local.can_start(n) for n in (regenerate, vocab, probe)] == [False, True, True]
    busy.ended = True
    assert local.can_start(regenerate)


def test_max_parallel_still_holds_jobs_that_would_fit_on_the_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    seen = run_recorded([engine("a", "features", 1, tmp_path), engine("b", "features", 1, tmp_path)], tmp_path,
                        warm=False, max_parallel=1)
    assert seen["b"]["start"] > seen["a"]["end"] and seen["a"]["gpus"] == seen["b"]["gpus"] == "0"


def test_a_local_job_that_needs_more_gpus_than_the_node_is_refused_not_waited_on(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RegraftError, match=r"^launcher.node_gpus=null: big holds .* 4 GPU\(s\) a node, serving vLLM, "
                                           r"tensor-parallel 4, but a node has 2 GPU\(s\) \(counted here by "
                                           r"CUDA_VISIBLE_DEVICES\)"):
        run_recorded([engine("big", "probe", 4, tmp_path)], tmp_path, warm=False)
    assert not list(tmp_path.glob("*.start"))  # never started


def test_a_slurm_run_on_a_machine_without_slurm_stops_before_any_work(tmp_path):
    """Refused with one line before anything is dispatched: no stage output, no MLflow store, no job folder."""
    (tmp_path / "bin").mkdir()
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={tmp_path}", "debug=tiny",
                           "launcher=slurm"], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PATH": str(tmp_path / "bin")})
    assert done.returncode == 1 and done.stdout.strip().splitlines() == [
        "error: launcher=slurm: Slurm's commands are not on this machine (sbatch, squeue, scontrol, scancel not on "
        "PATH) (fix: run regraft on a login node of the cluster, or plan here only: pipeline.plan=true writes each "
        "job's batch script)"], done.stdout + done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bin", "runs"]  # Hydra's run folder alone
    assert not list(tmp_path.glob("runs/*/jobs"))
