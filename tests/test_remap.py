"""remap: every destination row is the source row of the same target id or the chosen fallback; counts add up."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages import remap
from stages.common.contract.artifacts import read_manifest, staged_output
from stages.common.drafter.checkpoint import DrafterCheckpoint
from stages.common.contract.stage import compose_stage
from stages.common.drafter.config import OUTPUT_OF_LAYER
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.drafter.verifier import Verifier
from stages.common.drafter.vocab import VocabMap
from tests.conftest import random_map

ROOT = Path(__file__).resolve().parents[1]


def run_remap(drafter: Path, dest: Path, verifier: Path | None, out: Path, *extra: str):
    overrides = [f"drafter={drafter}", f"vocab_map={dest}", f"out={out}", *extra]
    if verifier is not None:
        overrides.append(f"verifier={verifier}")
    return remap.run(compose_stage("remap", overrides))


def save_map(vmap: VocabMap, path: Path) -> Path:
    torch.save({"d2t": vmap.d2t, "t2d": vmap.t2d}, path)
    return path


@pytest.fixture
def maps(vocab_size):
    return random_map(vocab_size, 96, seed=11), random_map(vocab_size, 80, seed=12)


def verifier_lm_head(target: Path) -> torch.Tensor:
    tensors = load_file(target / "model.safetensors")
    return tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])


def test_rows_follow_their_target_ids_and_counts_add_up(make_drafter, maps, target_dir, tmp_path):
    source_map, dest_map = maps
    source = make_drafter(source_map)
    result = run_remap(source, save_map(dest_map, tmp_path / "dest.pt"), target_dir, tmp_path / "out")
    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    head = verifier_lm_head(target_dir)
    source_ids = source_map.target_ids.tolist()
    from_source = 0
    for position, target_id in enumerate(dest_map.target_ids.tolist()):
        row = after["lm_head.weight"][position]
        if target_id in source_ids:
            assert torch.equal(row, before["lm_head.weight"][source_ids.index(target_id)])
            from_source += 1
        else:
            assert torch.equal(row, head[target_id])
    shared = len(set(source_ids) & set(dest_map.target_ids.tolist()))
    assert from_source == shared == result.metrics["rows_remapped"]
    assert result.metrics["rows_remapped"] + result.metrics["rows_from_fallback"] == 80
    assert result.metrics["rows_remapped"] + result.metrics["source_rows_dropped"] == 96
    assert torch.equal(after["d2t"], dest_map.d2t) and torch.equal(after["t2d"], dest_map.t2d)
    for name in before:
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(before[name], after[name]), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["draft_vocab_size"] == 80
    manifest = read_manifest(tmp_path / "out")
    assert manifest["metrics"]["rows_remapped"] == shared and manifest["report"]["comparison"]["shared_ids"] == shared


def test_remapped_drafter_predicts_the_same_target_tokens(make_drafter, maps, target_dir, tmp_path):
    """What remap is for: in target-id space the drafter's logits are unchanged wherever the ids are shared."""
    source_map, dest_map = maps
    source = make_drafter(source_map)
    run_remap(source, save_map(dest_map, tmp_path / "dest.pt"), target_dir, tmp_path / "out")
    old, new = Eagle3Drafter.from_checkpoint(source), Eagle3Drafter.from_checkpoint(tmp_path / "out")
    embeds, hidden = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    old_logits, new_logits = old(embeds, hidden).logits, new(embeds, hidden).logits
    shared = [t for t in dest_map.target_ids.tolist() if t in source_map.target_ids.tolist()]
    old_pos = [source_map.target_ids.tolist().index(t) for t in shared]
    new_pos = [dest_map.target_ids.tolist().index(t) for t in shared]
    assert len(shared) > 10
    assert torch.equal(old_logits[..., old_pos], new_logits[..., new_pos])
    # whereas the same drafter read with the new map as-is points most rows at other tokens
    as_is_agree = sum(o == n for o, n in zip(old_pos, new_pos))
    assert as_is_agree < len(shared) // 2


def test_fallback_mean_and_random(make_drafter, maps, target_dir, tmp_path):
    source_map, dest_map = maps
    source = make_drafter(source_map)
    dest = save_map(dest_map, tmp_path / "dest.pt")
    source_head = load_file(source / "model.safetensors")["lm_head.weight"]
    missing = [p for p, t in enumerate(dest_map.target_ids.tolist()) if t not in source_map.target_ids.tolist()]
    assert missing

    run_remap(source, dest, None, tmp_path / "mean", "fallback=mean")
    mean_head = load_file(tmp_path / "mean" / "model.safetensors")["lm_head.weight"]
    assert torch.allclose(mean_head[missing], source_head.double().mean(0).float().expand(len(missing), -1))

    run_remap(source, dest, None, tmp_path / "r1", "fallback=random", "seed=3")
    run_remap(source, dest, None, tmp_path / "r2", "fallback=random", "seed=3")
    r1 = load_file(tmp_path / "r1" / "model.safetensors")["lm_head.weight"]
    r2 = load_file(tmp_path / "r2" / "model.safetensors")["lm_head.weight"]
    assert torch.equal(r1, r2)
    assert r1[missing].abs().max() <= 1 / 32 ** 0.5 and r1[missing].std() > 0.05


def test_verifier_rows_can_match_the_source_scale(make_drafter, maps, target_dir, tmp_path):
    source_map, dest_map = maps
    source = make_drafter(source_map)
    run_remap(source, save_map(dest_map, tmp_path / "dest.pt"), target_dir, tmp_path / "out", "match_source_scale=true")
    head = load_file(tmp_path / "out" / "model.safetensors")["lm_head.weight"]
    source_head = load_file(source / "model.safetensors")["lm_head.weight"]
    missing = [p for p, t in enumerate(dest_map.target_ids.tolist()) if t not in source_map.target_ids.tolist()]
    assert head[missing].norm(dim=1).mean() == pytest.approx(float(source_head.norm(dim=1).mean()), rel=1e-4)


def test_tied_verifier_reads_its_embedding_rows(make_drafter, maps, tied_target_dir, tmp_path):
    source_map, dest_map = maps
    verifier = Verifier.open(tied_target_dir)
    assert verifier.tied and verifier.lm_head_name == "model.embed_tokens.weight"
    run_remap(make_drafter(source_map), save_map(dest_map, tmp_path / "dest.pt"), tied_target_dir, tmp_path / "out")
    head = load_file(tmp_path / "out" / "model.safetensors")["lm_head.weight"]
    embed = load_file(tied_target_dir / "model.safetensors")["model.embed_tokens.weight"]
    position, target_id = next((p, t) for p, t in enumerate(dest_map.target_ids.tolist())
                               if t not in source_map.target_ids.tolist())
    assert torch.equal(head[position], embed[target_id])


def test_speculators_source_to_sglang_rebuilds_verifier_lm_head(make_drafter, maps, target_dir, tmp_path):
    source_map, dest_map = maps
    source = make_drafter(source_map, layout="speculators")
    tensors = load_file(source / "model.safetensors")
    tensors["verifier_lm_head.weight"] = torch.randn(96, 32)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    run_remap(source, save_map(dest_map, tmp_path / "dest.pt"), target_dir, tmp_path / "out", "layout=sglang")
    out = DrafterCheckpoint.open(tmp_path / "out")
    assert out.layout == "sglang"
    assert torch.equal(out.tensor("verifier_lm_head.weight"), verifier_lm_head(target_dir)[dest_map.target_ids])
    # the same layers, named in the convention SGLang reads (the speculators source names them as vLLM reads them)
    assert out.config.aux_layer_ids == DrafterCheckpoint.open(source).config.with_aux_convention(
        OUTPUT_OF_LAYER).aux_layer_ids


def test_remap_onto_its_own_map_changes_nothing(make_drafter, maps, target_dir, tmp_path):
    source = make_drafter(maps[0])
    result = run_remap(source, source, target_dir, tmp_path / "out")
    assert result.metrics["positions_agree_before"] == 96 and result.metrics["rows_from_fallback"] == 0
    assert torch.equal(load_file(source / "model.safetensors")["lm_head.weight"],
                       load_file(tmp_path / "out" / "model.safetensors")["lm_head.weight"])


def test_incompatible_inputs_are_refused(make_drafter, maps, target_dir, tmp_path):
    source = make_drafter(maps[0])
    wrong_vocab = save_map(VocabMap.from_target_ids(torch.arange(10), 50), tmp_path / "small.pt")
    with pytest.raises(RegraftError, match="map is for a vocab of 50 ids"):
        run_remap(source, wrong_vocab, target_dir, tmp_path / "out")
    with pytest.raises(RegraftError, match="fallback=verifier needs the target model"):
        run_remap(source, save_map(maps[1], tmp_path / "dest.pt"), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_staged_output_leaves_nothing_half_written(tmp_path):
    out = tmp_path / "stage"
    with staged_output(out, "demo") as staged:
        (staged.path / "a.txt").write_text("first")
    assert read_manifest(out)["files"] == ["a.txt"]
    with pytest.raises(RuntimeError):
        with staged_output(out, "demo") as staged:
            (staged.path / "a.txt").write_text("second")
            raise RuntimeError("crash while writing")
    assert (out / "a.txt").read_text() == "first" and read_manifest(out)["complete"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["stage"]


def test_cli(make_drafter, maps, target_dir, tmp_path):
    source = make_drafter(maps[0])
    dest = save_map(maps[1], tmp_path / "dest.pt")
    ok = subprocess.run([sys.executable, "-m", "stages.remap", f"drafter={source}", f"vocab_map={dest}",
                         f"verifier={target_dir}", f"out={tmp_path / 'out'}", "layout=speculators"],
                        cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert DrafterCheckpoint.open(tmp_path / "out").layout == "speculators" and "rows remapped" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "stages.remap", f"drafter={tmp_path / 'nope'}", f"vocab_map={dest}",
                          f"out={tmp_path / 'x'}"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "nope" in bad.stderr
    typo = subprocess.run([sys.executable, "-m", "stages.remap", f"drafter={source}", f"vocab_map={dest}",
                           f"out={tmp_path / 'x'}", "fallback=verifyer"], cwd=ROOT, capture_output=True, text=True)
    assert typo.returncode == 2 and "verifyer" in typo.stderr
