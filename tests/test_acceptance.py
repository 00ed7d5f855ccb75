"""Acceptance measured while a fine-tune trains (finetune.eval_every, stages/finetune/acceptance.py): at its cadence,
the end and the kept state, on prompts held out from the probe's; its curve under MLflow's names; the state the stage
keeps by validation loss or by measured accept_len; and a run that measures trains exactly as one that does not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelines.tracking.store import step_metrics
from stages import finetune
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import check_config
from stages.common.drafter.acceptance import (accept_length, accept_length_per_request, load_eval_sets, load_prompts,
                                              per_set)
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.finetune.acceptance import AcceptanceProbe
from stages.schemas.finetune import FinetuneConfig
from tests.conftest import finetune_cfg


def measuring(chats: Path, *extra: str) -> list[str]:
    """A 27-step fine-tune (3 epochs of 9) measuring every 4 steps on 3 chats after the probe's first 2."""
    return ["init=scratch", "eval_every=4", f"acceptance.sets=[{{name: chat, path: {chats}}}]",
            "acceptance.skip=2", "acceptance.prompts=3", "acceptance.max_new_tokens=12", *extra]


def lines(out: Path, split: str) -> list[dict]:
    return [record for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if record["split"] == split]


@pytest.fixture(scope="module")
def runs(trained_target, chats, training_map, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    folder = tmp_path_factory.mktemp("acceptance")
    found = {}
    for name, extra in (("plain", ["init=scratch"]), ("by_loss", measuring(chats)),
                        ("by_acceptance", measuring(chats, "select_by=accept_len"))):
        out = folder / name
        found[name] = out, finetune.run(finetune_cfg(trained_target, chats, training_map, out, *extra))
    return found


def test_acceptance_is_measured_at_its_cadence_the_end_and_the_kept_state_under_mlflow_names(runs):
    out, result = runs["by_loss"]
    steps = [line["step"] for line in lines(out, "eval")]
    kept = min(lines(out, "val"), key=lambda line: line["loss"])["step"]  # validated each epoch: 9, 18 or 27
    assert steps[:7] == [4, 8, 12, 16, 20, 24, 27]  # every 4 steps, and the last
    assert steps[7:] == ([] if kept in steps[:7] else [kept])  # the kept state, once, at the step it is from
    assert all(line["accept_len"] >= 1.0 and line["accept_len/chat"] == line["accept_len"] for line in lines(out, "eval"))
    names = {name for name, _, _ in step_metrics(out)}
    assert {"eval/accept_len", "eval/accept_len/chat", "train/sim_accept_len", "val/sim_accept_len"} <= names
    assert result.metrics["eval_measurements"] == len(steps) and result.metrics["eval_seconds_total"] > 0


def test_measuring_changes_nothing_the_run_trains(runs):
    """The measurement decodes a copy of the weights and leaves the random state as it was: the same losses and the
    same exported weights as a run that does not measure."""
    plain, measured = runs["plain"][0], runs["by_loss"][0]
    assert [line["loss"] for line in lines(plain, "val")] == [line["loss"] for line in lines(measured, "val")]
    ours, theirs = (Eagle3Drafter.from_checkpoint(out / "drafter").state_dict() for out in (plain, measured))
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def kept_acceptance(out: Path, cfg) -> float:
    """The exported drafter measured again, as the run measured each state."""
    exported = Eagle3Drafter.from_checkpoint(out / "drafter", dtype=torch.float32)
    return AcceptanceProbe(cfg, torch.device("cpu")).measure(exported.state_dict(), exported.config)["accept_len"]


def test_each_selection_keeps_the_state_it_names(runs, trained_target, chats, training_map, tmp_path):
    by_loss_out, by_loss = runs["by_loss"]
    by_acceptance_out, by_acceptance = runs["by_acceptance"]
    val, measured = lines(by_loss_out, "val"), lines(by_loss_out, "eval")
    best_val_step = min(val, key=lambda line: line["loss"])["step"]
    assert by_loss.metrics["val_loss"] == min(line["loss"] for line in val)
    assert by_loss.metrics["eval_accept_len"] == next(line for line in measured if line["step"] == best_val_step)[
        "accept_len"]
    chosen = lines(by_acceptance_out, "eval")
    best = max(chosen, key=lambda line: line["accept_len"])
    assert by_acceptance.metrics["eval_accept_len"] == best["accept_len"] == max(line["accept_len"] for line in chosen)
    validated = {line["step"]: line["loss"] for line in lines(by_acceptance_out, "val")}
    assert by_acceptance.metrics["val_loss"] == validated[best["step"]]  # the kept state's own validation
    cfg = finetune_cfg(trained_target, chats, training_map, tmp_path / "again",
                       *measuring(chats, "select_by=accept_len"))
    assert kept_acceptance(by_acceptance_out, cfg) == pytest.approx(best["accept_len"])


def test_selecting_by_acceptance_without_measuring_is_refused(trained_target, chats, training_map, tmp_path):
    cfg = finetune_cfg(trained_target, chats, training_map, tmp_path / "out", "select_by=accept_len")
    with pytest.raises(RegraftError, match="select_by=accept_len: keeps the state with the best measured"):
        check_config(cfg, FinetuneConfig, "finetune")


def test_the_measured_prompts_are_held_out_from_the_probes(chats):
    probe = load_prompts(str(chats), 8, seed=0)
    held_out, sets = load_eval_sets([type("Set", (), {"name": "chat", "path": str(chats)})], 5, seed=0, skip=8)
    assert len(held_out) == 5 and sets == ["chat"] * 5
    assert held_out == load_prompts(str(chats), 13, seed=0)[8:]  # the next ones in the probe's own order
    assert probe == load_prompts(str(chats), 13, seed=0)[:8]


def test_pooled_and_per_request_accept_len_can_rank_two_drafters_differently():
    """Pooled (tokens over verify steps of all turns, the headline) weighs a long answer by its length; the mean of
    per-request figures weighs every turn alike. One drafter fast on a long answer, one fast on many short ones."""
    def turns(*pairs):
        return [{"completion_tokens": tokens, "verify_steps": steps, "conversation": 0} for tokens, steps in pairs]

    long_answer_fast = turns((100, 25), (4, 4), (4, 4))  # pooled 108/33 = 3.27, per request (4+1+1)/3 = 2.0
    short_answers_fast = turns((100, 50), (4, 1), (4, 1))  # pooled 108/52 = 2.08, per request (2+4+4)/3 = 3.33
    assert accept_length(long_answer_fast) == pytest.approx(108 / 33)
    assert accept_length_per_request(long_answer_fast) == pytest.approx(2.0)
    assert accept_length(long_answer_fast) > accept_length(short_answers_fast)
    assert accept_length_per_request(long_answer_fast) < accept_length_per_request(short_answers_fast)
    same = turns((10, 5), (10, 5))  # equal turns: the two agree
    assert accept_length(same) == accept_length_per_request(same) == 2.0
    assert per_set(long_answer_fast, ["chat"])["accept_len_per_request/chat"] == pytest.approx(2.0)


def test_the_summary_keeps_each_per_request_mean_and_says_when_it_ranks_the_phases_otherwise():
    from pipelines.report.summary import accept_len_orders, headline_numbers, story_caption

    def evaluated(pooled, per_request):
        return {"stage": "probe", "key": str(pooled), "metrics": {"accept_len": pooled,
                                                                 "accept_len_per_request": per_request}}

    agree = headline_numbers({"probe": evaluated(1.2, 1.1), "evaluate": evaluated(1.6, 1.5),
                              "baseline_evaluate": evaluated(1.4, 1.3)})
    assert agree["phase1/request_mean"] == 1.5 and agree["scratch/request_mean"] == 1.3
    assert accept_len_orders(agree) is None and story_caption({"numbers": agree}) is None
    differ = headline_numbers({"probe": evaluated(1.2, 1.1), "evaluate": evaluated(1.6, 1.3),
                               "baseline_evaluate": evaluated(1.4, 1.5)})
    said = accept_len_orders(differ)
    assert said == ("accept_len pooled over all turns ranks phase1 > scratch > phase0; its per-request mean ranks "
                    "scratch > phase1 > phase0 (scratch 1.500, phase1 1.300, phase0 1.100)")
    assert story_caption({"numbers": differ}) == said


def test_the_both_ways_block_shows_each_measured_phase_and_whether_the_orders_agree(tmp_path):
    from bench.accept_both import block

    def probe(pooled, per_request):
        return {"metrics": {"accept_len": pooled, "accept_len_per_request": per_request, "num_steps": 2,
                            "accept_rate_1": 0.5, "accept_rate_2": 0.25, "turns": 12}}

    summary = {"stages": {"probe": probe(1.2, 1.1), "evaluate": probe(1.6, 1.3), "baseline_evaluate": probe(1.4, 1.5)},
               "numbers": {"phase0/accept_len": 1.2, "phase0/request_mean": 1.1, "phase1/accept_len": 1.6,
                           "phase1/request_mean": 1.3, "scratch/accept_len": 1.4, "scratch/request_mean": 1.5},
               "overrides": []}
    text = block(tmp_path / "run", summary, "bench/accept_both.py --write")
    lines = text.splitlines()
    assert lines[3].split() == ["phase1", "(fine-tuned)", "1.600", "1.300", "0.500", "/", "0.250", "12"]
    assert "accept_len pooled over all turns ranks phase1 > scratch > phase0; its per-request mean ranks" in \
        " ".join(lines)
    summary["stages"]["baseline_evaluate"] = probe(1.4, 1.2)
    summary["numbers"]["scratch/request_mean"] = 1.2
    assert "rank the phases alike" in " ".join(block(tmp_path / "run", summary, "x").split())  # wrapped by the CPU name
