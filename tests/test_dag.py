"""The pipeline's DAG and cache keys from the real composed config (no stage runs here)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import pipelines.regraft  # noqa: F401  (registers every schema)
from pipelines.cache import keys_for
from pipelines.dag import Node, build_nodes, check_graph, resolve
from stages.common.cli import CONF_DIR
from stages.common.errors import RegraftError


def nodes_for(*overrides: str) -> list[Node]:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return build_nodes(compose("config", overrides=list(overrides)))


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {name for name in before if before[name] != after.get(name)}


def test_the_default_dag_wires_every_stage_to_its_inputs():
    nodes = {node.name: node for node in nodes_for()}
    assert list(nodes) == ["world", "probe", "vocab_map", "compare", "remap", "features", "finetune", "evaluate",
                           "baseline_finetune", "baseline_evaluate"]
    assert nodes["finetune"].upstream == ["features", "remap", "vocab_map", "world"]
    assert nodes["baseline_finetune"].config.init == "scratch" and nodes["baseline_finetune"].config.drafter is None
    assert nodes["evaluate"].config.drafter == "@finetune" and nodes["evaluate"].config.prompts == "@world/prompts_b.jsonl"
    resolved = resolve(nodes["remap"].config, {"world": Path("/w"), "vocab_map": Path("/m")})
    assert resolved.drafter == "/w/drafter_a" and resolved.vocab_map == "/m"


@pytest.mark.parametrize("override,expected", [
    ("finetune.lr=1e-3", {"finetune", "evaluate", "baseline_finetune", "baseline_evaluate"}),
    ("remap.fallback=mean", {"remap", "finetune", "evaluate"}),
    ("probe.num_steps=5", {"probe", "evaluate", "baseline_evaluate"}),  # evaluate measures as the probe does
    ("vocab_map.draft_vocab_size=512", {"vocab_map", "compare", "remap", "finetune", "evaluate",
                                        "baseline_finetune", "baseline_evaluate"}),
    ("world.seed=1", {"world", "probe", "vocab_map", "compare", "remap", "features", "finetune", "evaluate",
                      "baseline_finetune", "baseline_evaluate"}),
])
def test_a_changed_option_changes_the_keys_downstream_only(override, expected):
    assert changed(keys_for(nodes_for()), keys_for(nodes_for(override))) == expected


def test_trusting_the_targets_code_reaches_every_stage_that_loads_it():
    loads_target = {"probe", "vocab_map", "features", "finetune", "evaluate", "baseline_finetune", "baseline_evaluate"}
    for trusted in (False, True):
        nodes = nodes_for(f"target.trust_remote_code={str(trusted).lower()}")
        assert {node.name for node in nodes if node.config.get("trust_remote_code") is trusted} == loads_target
    assert {node.name for node in nodes_for("experiment=kimi_k25") if node.config.get("trust_remote_code")} \
        == loads_target


def test_a_scratch_finetune_is_its_own_baseline():
    keys = keys_for(nodes_for("finetune.init=scratch"))
    assert keys["finetune"] == keys["baseline_finetune"]


def test_real_inputs_leave_the_world_out(tmp_path):
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
    (tmp_path / "chats.jsonl").write_text("")
    nodes = nodes_for(f"target.path={tmp_path / 'target'}", f"source.path={tmp_path / 'drafter'}",
                      f"data.train={tmp_path / 'chats.jsonl'}", "data.prompts=builtin")
    assert "world" not in [node.name for node in nodes]
    before = keys_for(nodes)
    (tmp_path / "chats.jsonl").write_text('{"messages": []}\n')  # outside inputs are fingerprinted
    assert changed(before, keys_for(nodes)) >= {"vocab_map", "features", "finetune"}


def test_a_reference_to_a_later_stage_is_refused():
    nodes = nodes_for()
    nodes[2].config.data = "@evaluate"
    with pytest.raises(RegraftError, match="@evaluate"):
        check_graph(nodes)
