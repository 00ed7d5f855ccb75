"""features with `backend=vllm`: the target's states captured by vLLM's `extract_hidden_states` method (CPU build,
`.venv-vllm`, regraft's CPU connector), written as the hf path writes them.

Tolerance: both run the target in fp32 with different kernels (vLLM's CPU attention and fused norms against
transformers' eager ones), so the states differ by rounding: measured here at most ~4e-5 absolute on states of
magnitude ~10, 1e-6 relative per token. The test allows 1e-4 relative per token. Padding positions are not compared
(hf runs the pad tokens through the model, vLLM never sees them and stores zeros); no loss reads them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from stages import features, finetune
from stages.common.contract.artifacts import read_manifest
from stages.common.data.feature_shards import load_features
from stages.common.contract.stage import compose_stage
from stages.common.engines.vllm_engine import engine_available
from tests.test_finetune import read_metrics

pytestmark = [pytest.mark.engine, pytest.mark.slow,
              pytest.mark.skipif(not engine_available(), reason="no vLLM engine venv: run `make venv-vllm`")]


def shards(folder: Path) -> dict[str, torch.Tensor]:
    """Every row of a features output, padded as a fine-tune reads them."""
    manifest = read_manifest(folder)
    return load_features(folder, manifest["aux_layer_ids"], manifest["max_length"])


@pytest.fixture(scope="module")
def both(engine_target, engine_scratch_run, chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("features_vllm")
    common = [f"target={engine_target}", f"data={chats}", f"drafter={engine_scratch_run[0] / 'drafter'}",
              "max_length=48", "rows_per_shard=16"]
    runs = {backend: features.run(compose_stage("features", common + [f"out={out / backend}", f"backend={backend}"]))
            for backend in ("hf", "vllm")}
    return out, runs


def test_engine_states_equal_the_hf_states(both):
    out, runs = both
    hf, vllm = shards(out / "hf"), shards(out / "vllm")
    for name in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(hf[name], vllm[name]), name
    real = hf["attention_mask"].bool()
    for name in ("aux_hidden", "last_hidden"):
        a, b = hf[name][real].float(), vllm[name][real].float()
        relative = (a - b).norm(dim=-1) / a.norm(dim=-1)
        assert relative.max() < 1e-4, (name, relative.max())
    assert runs["vllm"].metrics["rows"] == runs["hf"].metrics["rows"] == 48
    assert not (out / "vllm" / "engine_states").exists()  # the connector's per-prompt files are spent


def test_a_finetune_on_engine_states_starts_at_the_same_loss(both, engine_target, training_map, tmp_path):
    out, _ = both
    common = [f"target={engine_target}", f"vocab_map={training_map}", "init=scratch", "ttt_steps=3",
              "micro_batch_size=4", "max_length=48", "lr=3e-3", "log_every=1", "val_fraction=0.2", "max_steps=2"]
    runs = {backend: finetune.run(compose_stage("finetune", common + [f"features={out / backend}",
                                                                       f"out={tmp_path / backend}"]))
            for backend in ("hf", "vllm")}
    first = {backend: [m for m in read_metrics(tmp_path / backend) if m["split"] == "train" and "loss" in m][0]
             for backend in runs}
    assert first["vllm"]["loss"] == pytest.approx(first["hf"]["loss"], rel=1e-5)  # step 1 reports step 0's loss
    assert first["vllm"]["full_acc_0"] == first["hf"]["full_acc_0"]
    assert runs["vllm"].metrics["val_loss"] == pytest.approx(runs["hf"].metrics["val_loss"], rel=1e-4)


def test_bfloat16_engine_states_are_stored_in_bfloat16(both, engine_target, engine_scratch_run, chats):
    """The engine run in bf16 stores its states as it computed them: 2 bytes a value, half fp32's bytes per token
    (57,344 at Kimi-K2.5's width), the same tokens, and states within bf16's rounding of the fp32 engine's: its
    8-bit mantissa gives ~4e-3 relative per value, and a forward in bf16 compounds it (measured here at most 8.2e-3
    relative per token for the aux states, 7.1e-3 for the final ones; the test allows 5e-2)."""
    out, runs = both
    hidden = json.loads((engine_target / "config.json").read_text())["hidden_size"]
    result = features.run(compose_stage("features", [
        f"target={engine_target}", f"data={chats}", f"drafter={engine_scratch_run[0] / 'drafter'}", "max_length=48",
        "rows_per_shard=16", f"out={out / 'vllm_bf16'}", "backend=vllm", "dtype=bfloat16"]))
    assert result.metrics["bytes_per_token"] == 4 * hidden * 2 == runs["vllm"].metrics["bytes_per_token"] / 2
    full, half = shards(out / "vllm"), shards(out / "vllm_bf16")
    assert half["aux_hidden"].dtype == half["last_hidden"].dtype == torch.bfloat16
    assert torch.equal(full["input_ids"], half["input_ids"])
    real = full["attention_mask"].bool()
    for name in ("aux_hidden", "last_hidden"):
        a, b = full[name][real].float(), half[name][real].float()
        relative = (a - b).norm(dim=-1) / a.norm(dim=-1)
        print(f"{name}: bf16 engine vs fp32 engine, largest relative difference per token {relative.max():.2e}")
        assert relative.max() < 5e-2, (name, relative.max())
