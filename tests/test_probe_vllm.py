"""probe/evaluate with `backend=vllm`: the real vLLM engine (CPU build, `.venv-vllm`) serving a regraft drafter.

The point: on the same prompts, drafter and num_steps, vLLM's acceptance equals regraft's hf backend's, count for
count. Both run the target and drafter in fp32 and decode greedily, so every argmax they take is the same unless
two logits tie to within rounding; on these prompts they never do, so the tolerance is zero: equal drafts, equal
accepted counts per position, equal tokens. And the agreement depends on the export: the same drafter served with
its aux ids in the other convention (vLLM reads every aux state one layer early) accepts differently.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from stages import probe
from stages.common.checkpoint import convert_checkpoint
from stages.common.drafter_config import OUTPUT_OF_LAYER
from stages.common.errors import RegraftError
from stages.common.stage import compose_stage
from stages.common.vllm_engine import VllmConfig, VllmEngine, engine_available
from tests.conftest import write_chats

pytestmark = [pytest.mark.engine, pytest.mark.slow,
              pytest.mark.skipif(not engine_available(), reason="no vLLM engine venv: run `make venv-vllm`")]

STEPS = 3


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    conversations = [[("user", "alpha")], [("user", "kilo"), ("assistant", "-"), ("user", "mike")],
                     [("user", "bravo charlie")], [("user", "lima")]]
    return write_chats(tmp_path_factory.mktemp("probe_vllm") / "prompts.jsonl", conversations)


def probe_cfg(target: Path, drafter: Path, out: Path, prompts: Path, *extra: str):
    return compose_stage("probe", [f"target={target}", f"drafter={drafter}", f"out={out}", f"prompts={prompts}",
                                   "max_new_tokens=24", f"num_steps={STEPS}", *extra])


@pytest.fixture(scope="module")
def both(engine_target, engine_scratch_run, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("probe_vllm")
    hf = probe.run(probe_cfg(engine_target, engine_scratch_run[0], out / "hf", prompts))
    vllm = probe.run(probe_cfg(engine_target, engine_scratch_run[0], out / "vllm", prompts, "backend=vllm"))
    return out, hf.metrics, vllm.metrics


def test_vllm_accepts_exactly_what_the_hf_backend_accepts(both):
    out, hf, vllm = both
    assert hf["accept_len"] > 2.0  # a drafter that drafts well, so the agreement is not all zeros
    assert vllm["drafts"] == hf["drafts"] > 0
    for position in range(1, STEPS + 1):
        assert vllm[f"accepted_at_{position}"] == hf[f"accepted_at_{position}"], position
    assert vllm["accept_len"] == hf["accept_len"]
    rows = {name: list(csv.DictReader((out / name / "per_prompt.csv").open())) for name in ("hf", "vllm")}
    for hf_row, vllm_row in zip(rows["hf"], rows["vllm"], strict=True):
        for column in ("prompt_tokens", "completion_tokens", "verify_steps", "text"):
            assert hf_row[column] == vllm_row[column], (column, hf_row, vllm_row)


def test_both_accept_lengths_are_reported_by_their_definitions(both):
    out, _, vllm = both
    rows = list(csv.DictReader((out / "vllm" / "per_prompt.csv").open()))
    accepted, drafts = sum(int(r["accepted"]) for r in rows), sum(int(r["drafts"]) for r in rows)
    assert drafts == vllm["drafts"]
    assert vllm["accept_len_vllm"] == pytest.approx(1 + accepted / drafts)  # vLLM's: prefill left out
    assert vllm["accept_len"] == pytest.approx(  # regraft's: emitted / target forwards, the prefill counted
        sum(int(r["completion_tokens"]) for r in rows) / sum(1 + int(r["drafts"]) for r in rows))
    assert accepted == sum(vllm[f"accepted_at_{p}"] for p in range(1, STEPS + 1))
    assert vllm["accept_len_vllm"] > vllm["accept_len"]
    assert "vLLM's 1+accepted/drafts" in json.loads((out / "vllm" / "manifest.json").read_text())["headline"]


def test_vllm_is_served_the_drafter_in_its_own_convention(both, engine_scratch_run):
    out, _, _ = both
    trained = json.loads((engine_scratch_run[0] / "drafter" / "config.json").read_text())
    served = json.loads((out / "vllm" / "served_drafter" / "config.json").read_text())
    trained_ids = trained["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert served["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in trained_ids]  # input of layer
    assert served["speculators_config"]["verifier"]["name_or_path"]


def test_a_drafter_served_one_layer_off_accepts_differently(both, engine_target, engine_scratch_run, tmp_path):
    """Served with output-of-layer ids (what `--layout speculators` wrote before), vLLM feeds the drafter each aux
    state one layer early: the answers stay lossless, the acceptance leaves the hf backend's."""
    out = both[0]
    wrong = convert_checkpoint(engine_scratch_run[0] / "drafter", tmp_path / "wrong", "speculators", OUTPUT_OF_LAYER)
    first_turns = [row for row in csv.DictReader((out / "hf" / "per_prompt.csv").open()) if row["turn"] == "0"]
    tokenizer = probe.load_tokenizer(engine_target)
    render = probe.chat_renderer(tokenizer)
    users = {0: "alpha", 1: "kilo", 2: "bravo charlie", 3: "lima"}  # the fixture's first turns, in file order
    with VllmEngine(VllmConfig(), tmp_path / "engine.log") as engine:
        engine.start(engine_target, speculative={"method": "eagle3", "model": str(wrong),
                                                  "num_speculative_tokens": STEPS})
        steps = []
        for row in first_turns:
            ids = tokenizer.encode(render([{"role": "user", "content": users[int(row["conversation"])]}]),
                                   add_special_tokens=False)
            before = engine.generate([ids[:2]], 1)["counters"]["vllm:spec_decode_num_drafts"]
            answer = engine.generate([ids], 24)
            assert tokenizer.decode(answer["outputs"][0], skip_special_tokens=True) == row["text"]  # lossless
            steps.append(1 + answer["counters"]["vllm:spec_decode_num_drafts"] - before)
    assert steps != [int(row["verify_steps"]) for row in first_turns]


def test_a_token_mismatch_names_the_turn_and_token():
    rows = [{"conversation": 2, "turn": 1, "prompt": [5, 6, 7], "tokens": [1, 2, 3, 4]}]
    with pytest.raises(RegraftError, match=r"at token 2 of conversation 2 turn 1"):
        probe.check_same_tokens(rows, [[1, 2, 9, 4]], "vLLM's plain greedy decoding", "out")
    probe.check_same_tokens(rows, [[1, 2, 3, 4]], "vLLM's plain greedy decoding", "out")
