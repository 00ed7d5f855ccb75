"""Drift measures and the closed-form re-alignment (stages/common/drafter/drift.py), on a target whose residual stream is
rotated: the same function, every hidden state h Q. There the exact answer is known: CKA 1 (a rotation), the ridge
map recovers Q^T (R^2 1), and the realigned drafter on the rotated target gives the source drafter's own loss."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.common.drafter import drift
from stages.common.data.chat import load_tokenizer, tokenized_chats
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.drafter.target import TargetModel
from stages.common.drafter.ttt import draft_vocab_ids, ttt_forward
from stages.world.toy import rotate_residual_stream
from tests.servers import needs_engine


def test_cka_and_ridge_on_known_answers():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(400, 16, generator=generator, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=generator, dtype=torch.float64))
    assert drift.linear_cka(a, a @ q) == pytest.approx(1.0)
    assert drift.linear_cka(a, 3 * a) == pytest.approx(1.0)
    assert drift.linear_cka(a, torch.randn(400, 16, generator=generator, dtype=torch.float64)) < 0.2
    m, c = drift.fit_ridge(a @ q, a, ridge=0.0)
    assert torch.allclose(m, q.T, atol=1e-8) and c.abs().max() < 1e-8
    assert drift.r_squared((a @ q) @ m + c, a) == pytest.approx(1.0)
    assert drift.relative_shift(a, a) == 0.0


@pytest.fixture(scope="module")
def rotated(trained_target, tmp_path_factory):
    model = AutoModelForCausalLM.from_pretrained(trained_target, torch_dtype=torch.float32)
    q = rotate_residual_stream(model, dose=1.0, seed=3)
    out = tmp_path_factory.mktemp("drift") / "rotated"
    model.save_pretrained(out)
    load_tokenizer(trained_target).save_pretrained(out)
    return out, q.float()


def test_a_rotated_target_keeps_its_function_and_rotates_its_states(trained_target, rotated, scratch_run, chats):
    drafter = Eagle3Drafter.from_checkpoint(scratch_run[0] / "drafter")
    ids, convention = drafter.config.aux_layer_ids, drafter.config.aux_convention
    a = TargetModel.load(trained_target, ids, convention)
    b = TargetModel.load(rotated[0], ids, convention)
    rows = tokenized_chats(load_tokenizer(trained_target), chats, 48)
    batch = {name: tensor[:8] for name, tensor in rows.items()}
    fa, fb = a.features(batch["input_ids"]), b.features(batch["input_ids"])
    assert torch.allclose(fa.logits, fb.logits, atol=1e-4)
    for k in range(3):
        width = fa.aux_hidden.shape[-1] // 3
        state_a, state_b = fa.aux_hidden[..., k * width:(k + 1) * width], fb.aux_hidden[..., k * width:(k + 1) * width]
        assert torch.allclose(state_a @ rotated[1], state_b, atol=1e-4)


def test_realigning_onto_a_rotated_target_restores_the_drafters_loss(trained_target, rotated, scratch_run, chats):
    drafter = Eagle3Drafter.from_checkpoint(scratch_run[0] / "drafter").eval()
    ids, convention = drafter.config.aux_layer_ids, drafter.config.aux_convention
    a = TargetModel.load(trained_target, ids, convention)
    b = TargetModel.load(rotated[0], ids, convention)
    rows = tokenized_chats(load_tokenizer(trained_target), chats, 48)
    real = rows["attention_mask"].bool()
    draft_ids = draft_vocab_ids(drafter)
    fa, fb = a.batch_features(rows, draft_ids=draft_ids), b.batch_features(rows, draft_ids=draft_ids)
    drifts, maps = drift.measure(fa.aux_hidden[real], fb.aux_hidden[real], ids, ridge=1e-8)  # exact: no shrinkage
    assert all(d.cka > 0.999 and d.r2_linear > 0.999 for d in drifts), drifts
    assert all(d.r2_identity < 0.5 for d in drifts), drifts  # as they are, B's states explain little of A's
    embed_map = drift.fit_embedding_map(a.model.get_input_embeddings().weight, b.model.get_input_embeddings().weight,
                                        drafter.config.rms_norm_eps, ridge=1e-8)
    fixed = drift.realigned(drafter, maps, embed_map)

    def loss(model, target, features) -> float:
        with torch.no_grad():
            return ttt_forward(model, target.embed, rows["input_ids"], rows["loss_mask"], features.aux_hidden,
                               features.signals, 3).metrics()["loss"]

    on_a, carried, realigned = loss(drafter, a, fa), loss(drafter, b, fb), loss(fixed, b, fb)
    assert realigned == pytest.approx(on_a, rel=1e-4)
    assert carried > on_a + 0.5, (carried, on_a)
    default = loss(drift.realigned(drafter, drift.measure(fa.aux_hidden[real], fb.aux_hidden[real], ids)[1],
                                   drift.fit_embedding_map(a.model.get_input_embeddings().weight,
                                                           b.model.get_input_embeddings().weight,
                                                           drafter.config.rms_norm_eps)), b, fb)
    assert default == pytest.approx(on_a, rel=1e-2)  # the default ridge's shrinkage costs a little


def test_diagnose_measures_the_rotation_and_writes_a_drafter_that_undoes_it(trained_target, rotated, scratch_run,
                                                                          chats, training_map, tmp_path):
    from stages import diagnose
    from stages.common.contract.stage import compose_stage

    common = [f"drafter={scratch_run[0] / 'drafter'}", f"target={rotated[0]}", f"data={chats}",
              f"vocab_map={training_map}", "max_length=48", "max_rows=48", "ridge=1e-8"]
    result = diagnose.run(compose_stage("diagnose", common + [f"target_a={trained_target}", f"out={tmp_path / 'd'}"]))
    m = result.metrics
    assert m["cka_mean"] > 0.999 and min(m[f"r2_linear_layer{i}"] for i in (0, 1, 2)) > 0.999, m
    assert m["transfer_gap"] > 0.5  # the rotation costs the carried drafter this much loss, all of it features
    report = json.loads((tmp_path / "d" / "diagnose.json").read_text())
    assert m["heldout_loss_0_realign"] == pytest.approx(report["remap_on_target_a"]["loss"], rel=1e-3)
    assert m["heldout_loss_0_realign"] < m["heldout_loss_0_remap"] - 0.5 and m["heldout_loss_0_scratch"] > m["heldout_loss_0_realign"]
    realigned = Eagle3Drafter.from_checkpoint(tmp_path / "d" / "realigned")
    assert realigned.fc.weight.shape == Eagle3Drafter.from_checkpoint(scratch_run[0] / "drafter").fc.weight.shape
    assert (tmp_path / "d" / "diagnose.png").stat().st_size > 0

    alone = diagnose.run(compose_stage("diagnose", common + [f"out={tmp_path / 'no_a'}"]))
    assert "transfer_gap" not in alone.metrics and not (tmp_path / "no_a" / "realigned").exists()
    assert "no target A" in alone.headline
    assert alone.metrics["heldout_loss_0_remap"] == pytest.approx(m["heldout_loss_0_remap"])


def test_diagnose_defaults_to_the_ridge_the_library_uses():
    """The schema states drift.RIDGE's value without importing torch: the two must not part."""
    import dataclasses

    from stages.schemas.diagnose import DiagnoseConfig

    assert next(f.default for f in dataclasses.fields(DiagnoseConfig) if f.name == "ridge") == drift.RIDGE


@pytest.fixture(scope="module")
def engine_rotated(engine_target, tmp_path_factory):
    """conftest's engine target (heads vLLM's CPU attention takes) with its residual stream rotated: target B."""
    model = AutoModelForCausalLM.from_pretrained(engine_target, torch_dtype=torch.float32)
    rotate_residual_stream(model, dose=0.5, seed=3)
    out = tmp_path_factory.mktemp("drift") / "engine_rotated"
    model.save_pretrained(out)
    load_tokenizer(engine_target).save_pretrained(out)
    return out


# Both paths run the targets in float32 with different kernels (vLLM's CPU attention and fused norms against
# transformers' eager ones): the states differ by ~1e-6 relative (tests/test_features_vllm.py), and every figure
# diagnose derives from them (CKA, R^2, step-0 losses and accuracies, the transfer gap) stays within DIAGNOSE_RTOL:
# measured here (AMD EPYC, 2 cores) at most 1.6e-7 relative over the 14 figures.
DIAGNOSE_RTOL, DIAGNOSE_ATOL = 1e-5, 1e-7


@needs_engine
def test_diagnose_on_vllm_gives_the_numbers_of_the_hf_path(engine_target, engine_rotated, engine_scratch_run, chats,
                                                          training_map, tmp_path):
    from stages import diagnose
    from stages.common.contract.artifacts import read_manifest
    from stages.common.contract.stage import compose_stage

    common = [f"drafter={engine_scratch_run[0] / 'drafter'}", f"target={engine_rotated}", f"target_a={engine_target}",
              f"data={chats}", f"vocab_map={training_map}", "max_length=48", "max_rows=48"]
    hf = diagnose.run(compose_stage("diagnose", common + [f"out={tmp_path / 'hf'}"]))
    vllm = diagnose.run(compose_stage("diagnose", common + [f"out={tmp_path / 'vllm'}", "backend=vllm"]))
    assert vllm.metrics.keys() == hf.metrics.keys() and "transfer_gap" in hf.metrics
    worst = max(abs(vllm.metrics[key] - value) / max(abs(value), 1e-12) for key, value in hf.metrics.items())
    print(f"diagnose, vLLM vs hf: largest relative difference {worst:.2e} over {len(hf.metrics)} figures")
    for key, value in hf.metrics.items():
        assert vllm.metrics[key] == pytest.approx(value, rel=DIAGNOSE_RTOL, abs=DIAGNOSE_ATOL), key
    manifest = read_manifest(tmp_path / "vllm")
    assert "vllm" in manifest["engine_versions"] and {"engine_a.log", "engine_b.log"} <= set(manifest["files"])
    assert not list((tmp_path / "vllm").glob("engine_states_*"))  # the connector's files are spent


def test_diagnose_holds_the_engines_gpus_only_on_vllm():
    from stages.schemas.diagnose import holds

    engine = {"backend": "vllm", "vllm": {"tensor_parallel_size": 8}}
    assert holds(engine, node_gpus=8).gpus == 8 and holds(engine, node_gpus=8).server == "vLLM, tensor-parallel 8"
    assert holds(engine, node_gpus=0).gpus == 0  # a CPU node: the engine computes on the CPU
    assert holds({**engine, "backend": "hf"}, node_gpus=8).gpus == 0
