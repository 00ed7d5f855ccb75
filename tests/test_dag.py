"""The pipeline's DAG and cache keys from the real composed config (no stage runs here)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import pipelines.regraft  # noqa: F401  (registers every schema)
from pipelines.core.cache import keys_for
from pipelines.core.dag import Node, build_nodes, check_graph, resolve
from stages.common.contract.stage import CONF_DIR
from stages.common.contract.errors import RegraftError

WORLD_SETS = [{"name": "prose", "path": "@world/prompts_b_prose.jsonl"},
              {"name": "code", "path": "@world/prompts_b_code.jsonl"}]  # conf/data/toy.yaml


def nodes_for(*overrides: str) -> list[Node]:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return build_nodes(compose("config", overrides=list(overrides)))


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {name for name in before if before[name] != after.get(name)}


def test_the_default_dag_wires_every_stage_to_its_inputs():
    nodes = {node.name: node for node in nodes_for()}
    assert list(nodes) == ["world", "source_map", "source_drafter", "probe", "vocab_map", "compare", "remap",
                           "diagnose", "features", "finetune", "evaluate", "baseline_finetune", "baseline_evaluate"]
    assert nodes["finetune"].upstream == ["features", "remap", "vocab_map", "world"]
    assert nodes["baseline_finetune"].config.init == "scratch" and nodes["baseline_finetune"].config.drafter is None
    assert nodes["evaluate"].config.drafter == "@finetune" and nodes["evaluate"].config.eval_sets == WORLD_SETS
    assert {nodes[name].stage for name in ("probe", "evaluate", "baseline_evaluate")} == {"probe"}
    resolved = resolve(nodes["remap"].config, {"source_drafter": Path("/s"), "world": Path("/w"),
                                               "vocab_map": Path("/m")})
    assert resolved.drafter == "/s/drafter" and resolved.vocab_map == "/m" and resolved.verifier == "/w/target_b"


def test_the_built_in_source_drafter_is_trained_by_the_finetune_stage_on_target_a():
    nodes = {node.name: node for node in nodes_for("finetune.lr=1e-3")}
    trained = nodes["source_drafter"]
    assert trained.stage == "finetune" and trained.upstream == ["source_map", "world"]
    assert (trained.config.target, trained.config.data, trained.config.init) == ("@world/target_a",
                                                                              "@world/data_a.jsonl", "scratch")
    assert (trained.config.lr, trained.config.max_steps, trained.config.ttt_steps) == (3e-3, 60, 3)  # not finetune.*
    assert nodes["source_map"].stage == "vocab_map" and nodes["source_map"].config.draft_vocab_size == 1024


@pytest.mark.parametrize("override,expected", [
    ("finetune.lr=1e-3", {"finetune", "evaluate", "baseline_finetune", "baseline_evaluate"}),
    ("remap.fallback=mean", {"remap", "diagnose", "finetune", "evaluate"}),
    # one measurement for both phases, and the one the fine-tunes take while they train (finetune.eval_every)
    ("probe.num_steps=5", {"probe", "evaluate", "baseline_evaluate", "finetune", "baseline_finetune"}),
    ("vocab_map.draft_vocab_size=512", {"vocab_map", "compare", "remap", "diagnose", "finetune", "evaluate",
                                        "baseline_finetune", "baseline_evaluate"}),
    ("source.build.finetune.max_steps=30", {"source_drafter", "probe", "compare", "remap", "diagnose", "features", "finetune",
                               "evaluate",
                               "baseline_finetune", "baseline_evaluate"}),  # features reads its aux layers
    ("world.seed=1", {"world", "source_map", "source_drafter", "probe", "vocab_map", "compare", "remap",
                      "diagnose", "features", "finetune", "evaluate", "baseline_finetune", "baseline_evaluate"}),
])
def test_a_changed_option_changes_the_keys_downstream_only(override, expected):
    assert changed(keys_for(nodes_for()), keys_for(nodes_for(override))) == expected


def test_a_fine_tune_that_measures_nothing_keeps_its_key_when_the_probe_changes():
    """finetune.eval_every=0 (the stage's default, the real experiment's): no measurement while it trains, so the
    probe's settings it would measure with do not reach its key, and changing them never trains it again."""
    quiet = "finetune.eval_every=0"
    assert changed(keys_for(nodes_for(quiet)), keys_for(nodes_for(quiet, "probe.num_steps=5"))) == \
        {"probe", "evaluate", "baseline_evaluate"}


def test_trusting_the_targets_code_reaches_every_stage_that_loads_it():
    loads_target = {"probe", "vocab_map", "features", "diagnose", "finetune", "evaluate", "baseline_finetune", "baseline_evaluate"}
    for trusted in (False, True):
        nodes = nodes_for(f"target.trust_remote_code={str(trusted).lower()}")
        new_target = [node for node in nodes if not node.name.startswith("source_")]  # those load target A
        assert {node.name for node in new_target if node.config.get("trust_remote_code") is trusted} == loads_target
    assert {node.name for node in nodes_for("experiment=kimi_k25") if node.config.get("trust_remote_code")} \
        == loads_target | {"regenerate"}  # the real case regenerates its data (its tokenizer is Kimi's code)
    for trusted in (False, True):  # and an online fine-tune's server runs the target as the stage does
        online = {node.name: node for node in nodes_for(f"target.trust_remote_code={str(trusted).lower()}",
                                                         "features.mode=online")}
        assert online["finetune"].config.engine.trust_remote_code is trusted


def test_regenerate_is_off_by_default_and_when_on_feeds_everything_that_trains():
    assert "regenerate" not in {node.name for node in nodes_for()}
    nodes = {node.name: node for node in nodes_for("pipeline.regenerate=true")}
    regenerate, names = nodes["regenerate"], list(nodes)
    assert regenerate.stage == "regenerate" and regenerate.phase == "prep"
    assert (regenerate.config.target, regenerate.config.data) == ("@world/target_b", "@world/data_b.jsonl")
    assert names.index("regenerate") < min(names.index(name) for name in ("vocab_map", "features", "finetune"))
    assert nodes["vocab_map"].config.data == nodes["features"].config.data == "@regenerate/regenerated.jsonl"
    online = {node.name: node for node in nodes_for("pipeline.regenerate=true", "pipeline.offline=false")}
    assert online["finetune"].config.data == online["baseline_finetune"].config.data == "@regenerate/regenerated.jsonl"
    assert nodes["probe"].config.eval_sets == WORLD_SETS  # the held-out prompts stay as they are


def test_online_features_have_no_features_node_and_fine_tunes_that_ask_a_server():
    offline = {node.name: node for node in nodes_for()}
    assert offline["finetune"].config.features == "@features" and not offline["finetune"].config.engine.enabled
    online = {node.name: node for node in nodes_for("features.mode=online", "finetune.engine.prefetch=4")}
    assert "features" not in online
    for name in ("finetune", "baseline_finetune"):
        config = online[name].config
        assert (config.features, config.data, config.engine.enabled) == (None, "@world/data_b.jsonl", True)
        assert config.engine.prefetch == 4
    kimi = {node.name: node for node in nodes_for("experiment=kimi_k25", "features.mode=online")}["finetune"].config
    assert (kimi.engine.connector, kimi.engine.dtype, kimi.engine.vllm.tensor_parallel_size) == ("stock", "bfloat16", 8)
    in_process = {node.name: node for node in nodes_for("features.mode=online", "pipeline.offline=false")}
    assert "features" not in in_process and not in_process["finetune"].config.engine.enabled


def test_a_regenerate_option_changes_the_keys_of_what_trains_on_its_answers_only():
    on = ("pipeline.regenerate=true",)
    assert changed(keys_for(nodes_for(*on)), keys_for(nodes_for(*on, "regenerate.temperature=0.7"))) == {
        "regenerate", "vocab_map", "compare", "remap", "diagnose", "features", "finetune", "evaluate", "baseline_finetune",
        "baseline_evaluate"}
    assert not changed(keys_for(nodes_for()), keys_for(nodes_for("regenerate.temperature=0.7")))  # off: unread


def test_diagnose_reads_both_targets_and_realign_trains_its_drafter():
    nodes = {node.name: node for node in nodes_for()}
    diagnose = nodes["diagnose"].config
    assert (diagnose.drafter, diagnose.target, diagnose.target_a) == ("@remap", "@world/target_b", "@world/target_a")
    assert nodes["finetune"].config.drafter == "@remap"
    realign = {node.name: node for node in nodes_for("finetune.init=realign", "pipeline.diagnose=false")}
    assert realign["finetune"].config.drafter == "@diagnose/realigned" and "diagnose" in realign
    assert "diagnose" not in {node.name for node in nodes_for("pipeline.diagnose=false")}


def test_a_scratch_finetune_is_its_own_baseline():
    keys = keys_for(nodes_for("finetune.init=scratch"))
    assert keys["finetune"] == keys["baseline_finetune"]


def test_real_inputs_leave_the_world_and_the_built_in_drafter_out(tmp_path):
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
    (tmp_path / "chats.jsonl").write_text("")
    nodes = nodes_for(f"target.path={tmp_path / 'target'}", f"source.path={tmp_path / 'drafter'}",
                      f"data.train={tmp_path / 'chats.jsonl'}", "data.eval_sets=[{name: builtin, path: builtin}]", "source.target=null")
    assert not {"world", "source_map", "source_drafter"} & {node.name for node in nodes}
    before = keys_for(nodes)
    (tmp_path / "chats.jsonl").write_text('{"messages": []}\n')  # outside inputs are fingerprinted
    assert changed(before, keys_for(nodes)) >= {"vocab_map", "features", "finetune"}


def test_a_reference_to_a_later_stage_is_refused():
    nodes = nodes_for()
    nodes[4].config.data = "@evaluate"
    with pytest.raises(RegraftError, match="@evaluate"):
        check_graph(nodes)


def test_the_scratch_baseline_is_built_in_the_given_sources_family(target_dir, tmp_path):
    """A given source drafter with `source.family` unset: the from-scratch baseline is of the checkpoint's own family
    (an MLA drafter's baseline an MLA drafter), so the two differ by their init only; a family set wins."""
    from stages.common.drafter.config import drafter_config_for
    from stages.common.drafter.eagle3 import Eagle3Drafter
    from tests.conftest import random_map

    vocab = drafter_config_for(target_dir, 16).vocab_size
    mla = Eagle3Drafter.initialised(drafter_config_for(target_dir, 16, family="mla"), random_map(vocab, 16, 0))
    source = mla.save(tmp_path / "mla")
    given = [f"source.path={source}", "source.build=null", f"target.path={target_dir}"]
    nodes = {node.name: node for node in nodes_for(*given)}
    assert nodes["baseline_finetune"].config.family == "mla"
    nodes = {node.name: node for node in nodes_for(*given, "source.family=eagle3.1")}
    assert nodes["baseline_finetune"].config.family == "eagle3.1"
    assert {node.name: node for node in nodes_for()}["baseline_finetune"].config.family == "eagle3"  # built-in world
