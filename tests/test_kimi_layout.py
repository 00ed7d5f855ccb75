"""Kimi-K2.5's released layout through regraft's readers (tests/kimi_miniature.py builds it): the language model's
config under `text_config` with model_type kimi_k2, the `language_model.*` weight names, the multimodal wrapper on
the hf path, and the MLA drafter it carries. The dress rehearsal runs the whole experiment on the same miniature."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from pipelines.modes.estimates import target_params
from stages.common.contract.artifacts import staged_output
from stages.common.contract.errors import RegraftError
from stages.common.data.chat_prompts import context_length
from stages.common.drafter.checkpoint import DrafterCheckpoint
from stages.common.drafter.config import INPUT_OF_LAYER, target_config
from stages.common.drafter.target import FinalNorm, TargetModel
from stages.common.drafter.verifier import Verifier
from tests import kimi_miniature


@pytest.fixture(scope="module")
def kimi(tokenizer_dir, chats, tmp_path_factory) -> Path:
    return kimi_miniature.build_target(tokenizer_dir, chats, tmp_path_factory.mktemp("kimi") / "K2.5", steps=2)


@pytest.fixture(scope="module")
def text_model(kimi) -> DeepseekV3ForCausalLM:
    """The DeepSeek-V3 the miniature wraps, as it was before wrapping."""
    return DeepseekV3ForCausalLM.from_pretrained(kimi.parent / "K2.5.build" / "trained").eval()


def test_the_folder_is_kimi_k25s_layout(kimi):
    raw = json.loads((kimi / "config.json").read_text())
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and raw["model_type"] == "kimi_k25"
    assert raw["text_config"]["model_type"] == "kimi_k2"
    names = set(Verifier.open(kimi).files.names())
    assert {"language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
            "language_model.model.norm.weight", "mm_projector.proj.0.weight"} <= names
    assert not any(".blocks." in name for name in names if name.startswith("language_model."))


def test_readers_see_the_language_model(kimi, text_model):
    config = target_config(kimi)
    assert config["model_type"] == "deepseek_v3" and config["num_hidden_layers"] == kimi_miniature.NUM_LAYERS
    assert context_length(kimi) == text_model.config.max_position_embeddings
    verifier = Verifier.open(kimi)
    assert verifier.lm_head_name == "language_model.lm_head.weight"
    assert torch.equal(verifier.files.get(verifier.lm_head_name), text_model.lm_head.weight)
    assert torch.equal(FinalNorm.load(kimi).weight, text_model.model.norm.weight)
    total, active = target_params(str(kimi))
    assert total == sum(p.numel() for p in text_model.parameters()) and active < total


def test_hf_path_runs_the_wrapped_language_model(kimi, text_model):
    ids = torch.tensor([[5, 17, 99, 300, 2, 41]])
    wrapped = TargetModel.load(kimi, [1, 3, 4])
    plain = TargetModel(text_model, [1, 3, 4])
    assert type(wrapped.model).__name__ == "Kimi_K25ForConditionalGeneration"
    ours, theirs = wrapped.features(ids), plain.features(ids)
    assert torch.equal(ours.aux_hidden, theirs.aux_hidden) and torch.equal(ours.logits, theirs.logits)


def test_the_source_drafter_is_the_kimi_lines_mla_format(kimi, tmp_path):
    drafter = DrafterCheckpoint.open(kimi_miniature.build_source_drafter(kimi, tmp_path / "drafter"))
    raw = json.loads((drafter.path / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and drafter.config.family == "mla"
    assert drafter.config.mla_dim("kv_lora_rank") + drafter.config.mla_dim("qk_rope_head_dim") == 576
    layers = kimi_miniature.NUM_LAYERS
    assert drafter.config.with_aux_convention(INPUT_OF_LAYER).aux_layer_ids == [2, layers // 2, layers - 3]


def test_a_failed_stage_keeps_only_its_logs(tmp_path):
    out = tmp_path / "features" / "key"
    with pytest.raises(RuntimeError, match="engine died"):
        with staged_output(out, "features") as staged:
            (staged.path / "shard_000.safetensors").write_bytes(b"half")
            (staged.path / "engine").mkdir()
            (staged.path / "engine" / "engine.log").write_text("the cause\n")
            raise RuntimeError("engine died")
    [kept] = out.parent.glob(".key.tmp-*")
    assert [p.relative_to(kept).as_posix() for p in sorted(kept.rglob("*"))] == ["engine", "engine/engine.log"]
    assert not out.exists()
    with pytest.raises(RuntimeError):
        with staged_output(tmp_path / "vocab_map" / "key", "vocab_map") as staged:
            (staged.path / "d2t.pt").write_bytes(b"half")
            raise RuntimeError("no logs")
    assert list((tmp_path / "vocab_map").iterdir()) == []


def test_an_in_process_cpu_engine_is_refused_for_kimi_before_any_work(kimi, target_dir):
    """vLLM's CPU build serves Kimi-K2.5 out of process only: the probe's and the features' check names the fix; a
    Llama target, or the engine out of process, passes."""
    from stages.schemas import features as features_schema, probe as probe_schema
    from stages.common.contract.hardware import gpu_visible
    from stages.common.engines.vllm_engine import VllmConfig

    if gpu_visible():
        pytest.skip("this machine has a GPU: the CPU build's limits do not apply")
    in_process, out_of_process = vars(VllmConfig(in_process=True)), vars(VllmConfig(in_process=False))
    with pytest.raises(RegraftError, match=r"probe.vllm.in_process=true: .* \(fix: set probe.vllm.in_process=false\)"):
        probe_schema.check_before_work({"backend": "vllm", "target": str(kimi), "vllm": in_process, "sglang": {}}, "probe")
    with pytest.raises(RegraftError, match="features.vllm.in_process=true"):
        features_schema.check_before_work({"backend": "vllm", "target": str(kimi), "vllm": in_process,
                                           "vllm_connector": "cpu"}, "features")
    for target, vllm in ((kimi, out_of_process), (target_dir, in_process)):
        probe_schema.check_before_work({"backend": "vllm", "target": str(target), "vllm": vllm, "sglang": {}}, "probe")
