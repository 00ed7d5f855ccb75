"""Data-parallel stages (features.parts, vocab_map.parts, regenerate.parts): K part nodes, each a cached output of its
own, and a join that reads them in order, equal to one run over all the data; a join refuses parts that are not of one
run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from safetensors.torch import load_file

import pipelines.regraft  # noqa: F401  (registers every schema)
from pipelines.core.dag import build_nodes
from pipelines.core.runner import run_dag
from pipelines.launch.inline import InlineLauncher
from stages import features
from stages.common.contract.artifacts import read_manifest
from stages.common.contract.errors import RegraftError
from stages.common.data.feature_shards import load_features
from stages.common.contract.stage import CONF_DIR, compose_stage


def prepared(outputs: Path, parts: int) -> dict:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.outputs={outputs}", "debug=tiny", f"features.parts={parts}",
                                           f"vocab_map.parts={parts}", "features.rows_per_shard=7"])
    nodes = [node for node in build_nodes(cfg) if node.stage in ("world", "vocab_map", "features")
             or node.name.startswith("source_")]
    return run_dag(nodes, Path(cfg.paths.cache), InlineLauncher(cfg.launcher, outputs / "jobs"), None,
                   Console(quiet=True))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    outputs = tmp_path_factory.mktemp("parts")
    return prepared(outputs, 1), prepared(outputs, 3)


def test_stages_in_parts_equal_one_run_over_all_the_data(runs):
    whole, parts = runs
    assert {"features_0", "features_1", "features_2", "vocab_map_0", "vocab_map_2"} <= set(parts)
    assert not {"features_0", "vocab_map_0"} & set(whole)
    a, b = (load_file(Path(run["vocab_map"].out) / "vocab_map.safetensors") for run in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)  # summed counts, same map
    manifest = read_manifest(whole["features"].out)
    rows = [load_features(run["features"].out, manifest["aux_layer_ids"], manifest["max_length"]) for run in runs]
    assert all(torch.equal(rows[0][name], rows[1][name]) for name in rows[0])
    sizes = [part.metrics["rows"] for name, part in parts.items() if name.startswith("features_")]
    assert sum(sizes) == whole["features"].metrics["rows"] == parts["features"].metrics["rows"] and min(sizes) > 0
    joined = read_manifest(parts["features"].out)
    assert joined["metrics"]["parts"] == 3 and joined["metrics"]["bytes"] == sum(
        read_manifest(parts[f"features_{k}"].out)["metrics"]["bytes"] for k in range(3))


def test_a_join_refuses_parts_of_other_runs(runs, tmp_path):
    whole, parts = runs
    other = compose_stage("features", [f"target={whole['features'].out}", "data=x", f"out={tmp_path / 'j'}",
                                       f"part_outputs=[{parts['features_0'].out},{parts['vocab_map'].out}]"])
    with pytest.raises(RegraftError, match="not a complete features output"):
        features.run(other)
    assert not (tmp_path / "j").exists()


def test_regenerate_parts_are_part_nodes_and_a_join_that_training_reads(tmp_path):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.outputs={tmp_path}", "debug=tiny", "pipeline.regenerate=true",
                                           "regenerate.parts=2"])
    nodes = {node.name: node for node in build_nodes(cfg)}
    assert [nodes[f"regenerate_{k}"].config.part for k in range(2)] == [0, 1]
    assert list(nodes["regenerate"].config.part_outputs) == ["@regenerate_0", "@regenerate_1"]
    assert nodes["vocab_map"].config.data == "@regenerate/regenerated.jsonl"
    assert set(nodes["vocab_map"].upstream) >= {"regenerate"}


def test_parts_past_the_samples_are_refused_with_the_fix(tmp_path):
    from stages import regenerate

    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = compose_stage("regenerate", [f"data={data}", f"out={tmp_path / 'out'}", "engine=openai",
                                       "server_url=http://127.0.0.1:9", "parts=2", "part=0"])
    with pytest.raises(RegraftError, match="regenerate.parts=2: more parts than the 1 samples"):
        regenerate.run(cfg)


def test_parts_cover_the_data_in_order_and_bad_counts_name_the_setting():
    from stages.common.data.parts import part_slice

    parts = [part_slice(10, part, 3, "features") for part in range(3)]
    assert [(part.start, part.stop) for part in parts] == [(0, 3), (3, 6), (6, 10)]
    assert part_slice(10, None, 3, "features") == slice(0, 10)
    with pytest.raises(RegraftError, match=r"features.parts=40: more parts than the 10 conversations \(fix: set "
                                           r"features.parts= to at most 10\)"):
        part_slice(10, 0, 40, "features")
    with pytest.raises(RegraftError, match=r"vocab_map.part=3: there are 3 parts \(0 to 2\) \(fix: set "
                                           r"vocab_map.part= below 3\)"):
        part_slice(10, 3, 3, "vocab_map")
