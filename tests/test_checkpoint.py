"""Drafter checkpoints: both layouts, lossless conversion, aux conventions, the module, and validation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from stages.common.drafter.checkpoint import DrafterCheckpoint, convert_checkpoint, main as convert_main
from stages.common.drafter.config import INPUT_OF_LAYER, OUTPUT_OF_LAYER, convert_aux_layer_ids, default_aux_layer_ids
from stages.common.drafter.eagle3 import Eagle3Drafter, KVCache, rope
from stages.common.contract.errors import RegraftError
from tests.conftest import random_map


def stored_names(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", framework="pt") as handle:
        return set(handle.keys())


def assert_same_checkpoint(a: Path, b: Path) -> None:
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


def test_sglang_speculators_sglang_round_trip_is_lossless(make_drafter, vocab_size, tmp_path):
    source = make_drafter(random_map(vocab_size, 64, seed=1), layout="sglang")
    assert "midlayer.self_attn.q_proj.weight" in stored_names(source)
    convert_checkpoint(source, tmp_path / "spec", "speculators")
    names = stored_names(tmp_path / "spec")
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    spec_config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec_config["speculators_model_type"] == "eagle3"
    assert spec_config["transformer_layer_config"]["vocab_size"] == vocab_size
    # the same layers (outputs of layers 0-2), named as vLLM and speculators read them: the state after j layers
    assert spec_config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert spec_config["regraft"]["aux_convention"] == INPUT_OF_LAYER
    convert_checkpoint(tmp_path / "spec", tmp_path / "back", "sglang")
    assert_same_checkpoint(source, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


def test_each_layout_carries_the_ids_its_engines_read_and_names_its_verifier(make_drafter, vocab_size, target_dir,
                                                                          tmp_path):
    source = make_drafter(random_map(vocab_size, 64, seed=1), layout="sglang")
    convert_checkpoint(source, tmp_path / "spec", "speculators", verifier=str(target_dir))
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert DrafterCheckpoint.open(tmp_path / "spec").config.verifier == str(target_dir)
    convert_checkpoint(tmp_path / "spec", tmp_path / "kept", "speculators", aux_convention=OUTPUT_OF_LAYER)
    assert json.loads((tmp_path / "kept" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    back = DrafterCheckpoint.open(tmp_path / "kept").config.with_aux_convention(INPUT_OF_LAYER)
    assert back.aux_layer_ids == [1, 2, 3] and back.verifier == str(target_dir)


def test_speculators_extras_survive_round_trip(make_drafter, vocab_size, tmp_path):
    source = make_drafter(random_map(vocab_size, 64, seed=2), layout="speculators")
    tensors = load_file(source / "model.safetensors")
    tensors["verifier_lm_head.weight"] = torch.randn(64, 32)
    tensors["embed_tokens.weight"] = torch.randn(vocab_size, 32)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["speculators_version"] = "0.3.0"
    (source / "config.json").write_text(json.dumps(config))
    convert_checkpoint(source, tmp_path / "sg", "sglang")
    sg = DrafterCheckpoint.open(tmp_path / "sg")
    assert sg.layout == "sglang" and "verifier_lm_head.weight" in sg
    convert_checkpoint(tmp_path / "sg", tmp_path / "back", "speculators")
    assert_same_checkpoint(source, tmp_path / "back")


def test_aux_layer_conventions_differ_by_one():
    assert default_aux_layer_ids(61, OUTPUT_OF_LAYER) == [1, 29, 57]
    assert default_aux_layer_ids(61, INPUT_OF_LAYER) == [2, 30, 58]
    assert default_aux_layer_ids(32, OUTPUT_OF_LAYER) == [1, 15, 28]
    assert convert_aux_layer_ids([2, 30, 58], INPUT_OF_LAYER, OUTPUT_OF_LAYER) == [1, 29, 57]
    assert convert_aux_layer_ids([1, 29, 57], OUTPUT_OF_LAYER, OUTPUT_OF_LAYER) == [1, 29, 57]


def test_convention_is_recorded_inferred_and_converted(make_drafter, vocab_size, tmp_path):
    source = make_drafter(random_map(vocab_size, 64, seed=3))
    checkpoint = DrafterCheckpoint.open(source)
    assert (checkpoint.config.aux_convention, checkpoint.config.aux_convention_source) == (OUTPUT_OF_LAYER, "recorded")

    convert_checkpoint(source, tmp_path / "input", "sglang", aux_convention=INPUT_OF_LAYER)
    converted = json.loads((tmp_path / "input" / "config.json").read_text())
    assert converted["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert converted["regraft"]["aux_convention"] == INPUT_OF_LAYER

    # A Kimi-style sglang config with ids [2, 30, 58] and no record of its convention: inferred from the first id.
    del converted["regraft"]
    converted["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 30, 58]
    (tmp_path / "input" / "config.json").write_text(json.dumps(converted))
    kimi_like = DrafterCheckpoint.open(tmp_path / "input").config
    assert kimi_like.aux_convention == INPUT_OF_LAYER and kimi_like.aux_convention_source.startswith("inferred")
    assert kimi_like.with_aux_convention(OUTPUT_OF_LAYER).aux_layer_ids == [1, 29, 57]


def test_module_loads_both_layouts_with_identical_forward(make_drafter, vocab_size, tmp_path):
    source = make_drafter(random_map(vocab_size, 64, seed=4))
    convert_checkpoint(source, tmp_path / "spec", "speculators")
    a, b = Eagle3Drafter.from_checkpoint(source), Eagle3Drafter.from_checkpoint(tmp_path / "spec")
    torch.manual_seed(0)
    embeds, aux = torch.randn(2, 7, 32), torch.randn(2, 7, 96)
    out_a, out_b = a(embeds, a.project_aux(aux)), b(embeds, b.project_aux(aux))
    assert out_a.logits.shape == (2, 7, 64) and out_a.hidden.shape == (2, 7, 32)
    assert torch.equal(out_a.logits, out_b.logits)
    assert torch.equal(a.draft_to_target(torch.arange(64)), random_map(vocab_size, 64, seed=4).target_ids)


def test_module_save_load_preserves_forward(make_drafter, vocab_size, tmp_path):
    model = Eagle3Drafter.from_checkpoint(make_drafter(random_map(vocab_size, 64, seed=5)))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save(tmp_path / "saved", layout="speculators")
    loaded = Eagle3Drafter.from_checkpoint(tmp_path / "saved")
    embeds, hidden = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    assert torch.equal(model(embeds, hidden).logits, loaded(embeds, hidden).logits)


def test_kv_cache_matches_full_forward(make_drafter, vocab_size):
    model = Eagle3Drafter.from_checkpoint(make_drafter(random_map(vocab_size, 64, seed=6)))
    embeds, hidden = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    full = model(embeds, hidden).logits
    cache = KVCache()
    prefix = model(embeds[:, :4], hidden[:, :4], cache=cache).logits
    steps = [model(embeds[:, i:i + 1], hidden[:, i:i + 1], cache=cache).logits for i in (4, 5)]
    assert torch.allclose(torch.cat([prefix, *steps], dim=1), full, atol=1e-5)


def test_rope_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0)
    positions = torch.arange(9)[None]
    q, k = torch.randn(1, 4, 9, 16), torch.randn(1, 4, 9, 16)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(rope(q, positions, 500000.0), expected_q, atol=1e-5)
    assert torch.allclose(rope(k, positions, 500000.0), expected_k, atol=1e-5)


def test_convert_cli(make_drafter, vocab_size, tmp_path, capsys):
    source = make_drafter(random_map(vocab_size, 64, seed=7))
    assert convert_main([str(source), str(tmp_path / "spec"), "--layout", "speculators"]) == 0
    assert DrafterCheckpoint.open(tmp_path / "spec").layout == "speculators"
    assert convert_main([str(tmp_path / "nowhere"), str(tmp_path / "x"), "--layout", "sglang"]) == 1
    assert "no config.json" in capsys.readouterr().err


# ---------------------------------------------------------------- validation: one clear error per fault


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fault, message", [
    (lambda p: edit_config(p, lambda c: c.update(draft_vocab_size=65)), "config says [65"),
    (lambda p: edit_config(p, lambda c: c.update(architectures=["LlamaForCausalLM"])), "not an EAGLE-3 drafter"),
    (lambda p: edit_config(p, lambda c: c.pop("hidden_size")), "has no hidden_size"),
    (lambda p: edit_tensors(p, lambda t: t.pop("fc.weight")), "missing tensors ['fc.weight']"),
    (lambda p: edit_tensors(p, lambda t: t.update({"midlayer.extra.weight": torch.zeros(2)})), "unknown tensors"),
    (lambda p: edit_tensors(p, lambda t: t.update(d2t=t["d2t"].to(torch.int32))), "d2t is torch.int32"),
    (lambda p: edit_tensors(p, lambda t: t["t2d"].__setitem__(0, ~t["t2d"][0])), "t2d marks"),
    (lambda p: edit_tensors(p, lambda t: t["d2t"].__setitem__(-1, 10_000)), "outside the target vocab"),
    (lambda p: edit_tensors(p, lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1)), "same target id"),
    (lambda p: (p / "model.safetensors").write_bytes(b"garbage"), "not a readable safetensors file"),
])
def test_validation_errors_name_the_file_and_the_fault(make_drafter, vocab_size, fault, message):
    path = make_drafter(random_map(vocab_size, 64, seed=8))
    fault(path)
    with pytest.raises(RegraftError) as error:
        DrafterCheckpoint.open(path)
    text = str(error.value)
    assert message in text and str(path) in text and "fix:" in text and "\n" not in text
