"""compare: the numbers that explain a failed fine-tune, on constructed maps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from stages.common.drafter.vocab import VocabMap, build_vocab_map, compare_vocab_maps


def vmap(ids: list[int], vocab_size: int = 20) -> VocabMap:
    return VocabMap.from_target_ids(torch.tensor(ids), vocab_size)


def test_constructed_maps():
    a, b = vmap(list(range(10))), vmap([0, 1, 2, 5, 6, 7, 8, 9, 10, 11])
    result = compare_vocab_maps(a, b)
    assert (result.shared_ids, result.only_in_a, result.only_in_b) == (8, 2, 2)
    assert (result.positions_agree, result.first_divergence) == (3, 3)
    assert not result.aligned
    assert result.headline() == "3 of 10 draft positions agree; 8 target ids shared (2 only in A, 2 only in B)"


def test_identical_and_different_sized_maps():
    same = compare_vocab_maps(vmap([1, 4, 9]), vmap([1, 4, 9]))
    assert same.aligned and same.first_divergence is None and same.positions_agree == 3
    longer = compare_vocab_maps(vmap([1, 4, 9]), vmap([1, 4, 9, 12]))
    assert longer.first_divergence == 3 and longer.positions_agree == 3 and longer.only_in_b == 1


def test_reordered_frequencies_share_ids_but_not_positions():
    """The real failure in miniature: most ids shared, yet almost no position points at the same token."""
    vocab_size, size = 5000, 1000
    generator = torch.Generator().manual_seed(0)
    ranks = torch.randperm(vocab_size, generator=generator)
    counts_a = (vocab_size - ranks).to(torch.int64) * 10
    counts_b = counts_a.clone()
    swap = torch.randperm(vocab_size, generator=generator)[:400]  # a new domain reorders some frequencies
    counts_b[swap] = torch.randint(0, 50_000, (400,), generator=generator)
    a, b = build_vocab_map(counts_a, size), build_vocab_map(counts_b, size)
    result = compare_vocab_maps(a, b)
    assert result.shared_ids > 0.8 * size
    assert result.positions_agree < 0.2 * size
    shared = b.target_ids[torch.isin(b.target_ids, a.target_ids)]
    assert result.b_tokens_covered_by_shared == float(counts_b[shared].sum()) / float(counts_b.sum())
    assert result.shared_ids + result.only_in_b == size == result.shared_ids + result.only_in_a


def test_cli_writes_report(tmp_path):
    torch.save({"d2t": vmap([0, 2, 4]).d2t, "t2d": vmap([0, 2, 4]).t2d}, tmp_path / "a.pt")
    torch.save({"d2t": vmap([0, 3, 4]).d2t, "t2d": vmap([0, 3, 4]).t2d}, tmp_path / "b.pt")
    done = subprocess.run([sys.executable, "-m", "stages.compare", f"a={tmp_path / 'a.pt'}", f"b={tmp_path / 'b.pt'}",
                           f"out={tmp_path / 'cmp'}"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["positions_agree"] == 2 and report["first_divergence"] == 1 and report["shared_ids"] == 2
