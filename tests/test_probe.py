"""probe/evaluate with the hf backend: greedy speculative decoding is lossless, and accept_len counts right."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from stages import probe
from stages.common.contract.stage import compose_stage
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.drafter.spec_decode import SpeculativeDecoder, greedy_generate
from stages.common.drafter.target import TargetModel
from stages.common.drafter.vocab import load_vocab_map
from tests.conftest import write_chats


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    conversations = [[("user", "alpha")], [("user", "kilo"), ("assistant", "-"), ("user", "mike")],
                     [("user", "bravo charlie")], [("user", "lima")]]
    return write_chats(tmp_path_factory.mktemp("probe") / "prompts.jsonl", conversations)


@pytest.fixture(scope="module")
def misaligned_drafter(scratch_run, tmp_path_factory) -> Path:
    """The trained drafter with its lm_head rows shuffled: the failure regraft exists to catch."""
    drafter = Eagle3Drafter.from_checkpoint(scratch_run[0] / "drafter")
    permutation = torch.randperm(drafter.lm_head.weight.shape[0], generator=torch.Generator().manual_seed(0))
    drafter.lm_head.weight.data = drafter.lm_head.weight.data[permutation].clone()
    return drafter.save(tmp_path_factory.mktemp("probe") / "misaligned")


def probe_cfg(target: Path, drafter: Path, out: Path, prompts: Path, *extra: str):
    return compose_stage("probe", [f"target={target}", f"drafter={drafter}", f"out={out}",
                                   f"eval_sets=[{{name: chats, path: '{prompts}'}}]",
                                   "max_new_tokens=24", *extra])


def test_probe_is_lossless_and_ranks_drafters(trained_target, scratch_run, misaligned_drafter, make_drafter,
                                              training_map, prompts, tmp_path):
    random_drafter = make_drafter(load_vocab_map(training_map), "random", seed=3)
    results = {}
    for name, drafter in [("good", scratch_run[0]), ("random", random_drafter), ("misaligned", misaligned_drafter)]:
        results[name] = probe.run(probe_cfg(trained_target, drafter, tmp_path / name, prompts))
        metrics = results[name].metrics
        assert metrics["turns"] == 5  # each turn checked token for token against plain greedy, or the stage raises
        assert 1.0 <= metrics["accept_len"] <= 4.0
        rows = list(csv.DictReader((tmp_path / name / "per_prompt.csv").open()))
        assert len(rows) == 5
        assert metrics["accept_len"] == pytest.approx(
            sum(int(r["completion_tokens"]) for r in rows) / sum(int(r["verify_steps"]) for r in rows))
        assert metrics["accept_rate_1"] >= metrics["accept_rate_2"] >= metrics["accept_rate_3"]
    accept = {name: result.metrics["accept_len"] for name, result in results.items()}
    assert accept["good"] > 2.0 and accept["good"] > accept["misaligned"] + 0.5 and accept["random"] < 1.5, accept
    assert (tmp_path / "good" / "acceptance.png").stat().st_size > 0


def test_a_finetune_output_is_probed_as_its_drafter(trained_target, scratch_run, prompts, tmp_path):
    """Phase 1 hands the probe a finetune output folder; it measures the drafter/ inside it."""
    phase0 = probe.run(probe_cfg(trained_target, scratch_run[0] / "drafter", tmp_path / "p", prompts))
    phase1 = probe.run(probe_cfg(trained_target, scratch_run[0], tmp_path / "e", prompts))
    assert phase1.metrics["accept_len"] == phase0.metrics["accept_len"]
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["stage"] == "probe"


def test_each_eval_set_is_measured_on_its_own_beside_the_completed_token_weighted_aggregate(
        trained_target, scratch_run, prompts, tmp_path):
    short = write_chats(tmp_path / "short.jsonl", [[("user", "alpha")], [("user", "lima")]])
    cfg = compose_stage("probe", [f"target={trained_target}", f"drafter={scratch_run[0]}", f"out={tmp_path / 'o'}",
                                  f"eval_sets=[{{name: chats, path: '{prompts}'}}, {{name: short, path: '{short}'}}]",
                                  "max_new_tokens=24"])
    result = probe.run(cfg)
    metrics, rows = result.metrics, list(csv.DictReader((tmp_path / "o" / "per_prompt.csv").open()))
    assert [metrics["turns/chats"], metrics["turns/short"], metrics["turns"]] == [5, 2, 7]
    for name in ("chats", "short"):
        mine = [row for row in rows if row["set"] == name]
        assert metrics[f"accept_len/{name}"] == pytest.approx(
            sum(int(r["completion_tokens"]) for r in mine) / sum(int(r["verify_steps"]) for r in mine))
    tokens = {name: metrics[f"completion_tokens/{name}"] for name in ("chats", "short")}
    steps = {name: tokens[name] / metrics[f"accept_len/{name}"] for name in tokens}
    assert metrics["accept_len"] == pytest.approx(sum(tokens.values()) / sum(steps.values()))
    alone = probe.run(probe_cfg(trained_target, scratch_run[0], tmp_path / "alone", prompts))
    assert alone.metrics["accept_len"] == metrics["accept_len/chats"]  # a set measures the same alone or beside others
    assert f"(chats {metrics['accept_len/chats']:.2f}, short {metrics['accept_len/short']:.2f})" in result.headline


def test_eval_sets_need_names_of_their_own(trained_target, scratch_run, prompts, tmp_path):
    twice = f"eval_sets=[{{name: a, path: '{prompts}'}}, {{name: a, path: '{prompts}'}}]"
    with pytest.raises(RegraftError, match="names a more than once"):
        probe.run(compose_stage("probe", [f"target={trained_target}", f"drafter={scratch_run[0]}",
                                          f"out={tmp_path / 'o'}", twice]))


class ScriptedDrafts(SpeculativeDecoder):
    """Test double of the drafter: proposes the greedy reference for `right` positions, then wrong tokens."""

    def __init__(self, target: TargetModel, drafter: Eagle3Drafter, reference: list[int], right: int):
        super().__init__(target, drafter, num_steps=3)
        self.reference, self.right, self.emitted = reference, right, 0

    def draft(self, cache, aux, next_tokens):
        # The first call follows the prefill's one token; each later one the tokens of the last verify.
        self.emitted = 1 if self.emitted == 0 else self.emitted + len(next_tokens)
        at = self.emitted
        drafts = self.reference[at: at + self.right]
        return drafts + [(self.reference[at + i] + 1) % 64 for i in range(len(drafts), self.num_steps)]


@pytest.mark.parametrize("right", [0, 2, 3])
def test_accept_len_equals_a_hand_count(trained_target, scratch_run, right):
    drafter = Eagle3Drafter.from_checkpoint(scratch_run[0] / "drafter")
    target = TargetModel.load(trained_target, drafter.config.aux_layer_ids, drafter.config.aux_convention)
    prompt, budget = [3, 7, 9], 21
    reference = greedy_generate(target, prompt, budget + 8, stop_ids=set()).tokens
    generation = ScriptedDrafts(target, drafter, reference, right).generate(prompt, budget, stop_ids=set())
    assert generation.tokens == reference[:budget]
    verifies = -(-(budget - 1) // (right + 1))  # each verify emits the accepted drafts plus the target's token
    assert generation.accepted == [right] * verifies
    assert generation.target_forwards == 1 + verifies
    assert generation.accept_len == pytest.approx(budget / (1 + verifies))  # 21/21, 21/8, 21/6


def test_hf_backend_refuses_tree_drafting(trained_target, scratch_run, prompts, tmp_path):
    with pytest.raises(RegraftError, match="topk"):
        probe.run(probe_cfg(trained_target, scratch_run[0], tmp_path / "t", prompts, "topk=2"))
    assert not (tmp_path / "t").exists()


def parting_row(cfg, drafter: Path, tied: bool) -> dict | None:
    """An answer that takes the runner-up where bf16's greedy path (cfg.target's) has its first pick: at a rounding
    tie (float32 separates the two by no more than bf16's logits stray from float32's there), or far from one."""
    low, exact = probe.hf_target(cfg, drafter, "bfloat16"), probe.hf_target(cfg, drafter, "float32")
    for ids in ([5, 6, 7], [9, 3, 11, 4], [12, 2], [8, 13, 1, 6]):
        expected = greedy_generate(low, ids, 32, set()).tokens
        for at in range(len(expected)):
            context = ids + expected[:at]
            top = exact.features(torch.tensor([context])).logits[0, -1].topk(2).indices.tolist()
            runner_up = top[1] if top[0] == expected[at] else top[0]
            margin, rounding = probe.tie_margin(low, exact, context, expected[at], runner_up)
            if (margin <= rounding) if tied else (margin > 2 * rounding):
                return {"prompt": ids, "tokens": expected[:at] + [runner_up], "conversation": 0, "turn": 0}
    return None


def test_the_hf_cross_check_tells_a_rounding_tie_from_a_wrong_token(target_dir, trained_target, scratch_run, prompts,
                                                                    tmp_path):
    """vLLM's answers are held exactly against its own plain greedy; against the hf target in bf16 an answer may
    part where two tokens' logits are closer than bf16's rounding there: a tie, counted (the untrained target's
    near-flat logits have them). The runner-up taken where the logits stand apart (the trained target's), or any
    difference in float32, is an error."""
    drafter = scratch_run[0] / "drafter"
    flat = probe_cfg(target_dir, drafter, tmp_path / "flat", prompts, "dtype=bfloat16", "max_new_tokens=32")
    sharp = probe_cfg(trained_target, drafter, tmp_path / "sharp", prompts, "dtype=bfloat16", "max_new_tokens=32")
    tied, apart = parting_row(flat, drafter, tied=True), parting_row(sharp, drafter, tied=False)
    assert tied is not None and apart is not None
    counts = probe.check_against_hf(flat, [tied], drafter, stops=[])
    assert counts["hf_turns_rounding_ties"] == 1 and counts["hf_turns_equal"] == 0
    with pytest.raises(RegraftError, match="not lossless: vLLM with speculation left the hf target's greedy"):
        probe.check_against_hf(sharp, [apart], drafter, stops=[])
    strict = probe_cfg(target_dir, drafter, tmp_path / "strict", prompts, "dtype=float32", "max_new_tokens=32")
    with pytest.raises(RegraftError, match="not lossless"):
        probe.check_against_hf(strict, [tied], drafter, stops=[])
