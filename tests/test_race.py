"""A race under one budget (pipelines/modes/race.py): rungs of a fine-tune continue exactly as an uninterrupted run; in
both worlds the race picks what every candidate trained to the end ranks first, for at most half that compute; a
rerun runs nothing and one more candidate reuses every rung already trained."""
from __future__ import annotations


import pytest
import torch

from stages import finetune
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.stage import compose_stage
from tests.test_finetune import read_metrics


def test_rungs_continue_exactly_as_an_uninterrupted_run(trained_target, chats, training_map, tmp_path):
    common = [f"target={trained_target}", f"data={chats}", f"vocab_map={training_map}", "init=scratch",
              "ttt_steps=2", "micro_batch_size=4", "max_length=48", "lr=3e-3", "val_fraction=0.2", "max_steps=8",
              "epochs=3", "log_every=1", "checkpoint_every=100"]
    whole = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'whole'}"]))
    rungs = [f"checkpoint_dir={tmp_path / 'shared'}"]
    first = finetune.run(compose_stage("finetune", common + rungs + [f"out={tmp_path / 'r0'}", "stop_at=3"]))
    last = finetune.run(compose_stage("finetune", common + rungs + [f"out={tmp_path / 'r1'}", "stop_at=8"]))
    assert first.metrics["val_loss"] > 0 and [m["step"] for m in read_metrics(tmp_path / "r0")
                                              if m["split"] == "train"] == [1, 2, 3]
    assert last.metrics["val_loss"] == pytest.approx(whole.metrics["val_loss"], rel=1e-6)
    untimed = lambda folder: [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in read_metrics(folder)]
    for x, y in zip(untimed(tmp_path / "r1"), untimed(tmp_path / "whole"), strict=True):
        assert x == y, {k: (x[k], y.get(k)) for k in x if x[k] != y.get(k)}  # every step logged once, the same
    a = Eagle3Drafter.from_checkpoint(tmp_path / "whole" / "drafter").state_dict()
    b = Eagle3Drafter.from_checkpoint(tmp_path / "r1" / "drafter").state_dict()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def test_a_run_resumed_from_its_last_steps_checkpoint_still_validates(trained_target, chats, training_map,
                                                                     tmp_path):
    """A job requeued after the last step's checkpoint but before the validation that follows it."""
    common = [f"target={trained_target}", f"data={chats}", f"vocab_map={training_map}", "init=scratch",
              "ttt_steps=2", "micro_batch_size=4", "max_length=48", "lr=3e-3", "val_fraction=0.2", "max_steps=4",
              "epochs=3", "log_every=1", "checkpoint_every=1", f"checkpoint_dir={tmp_path / 'work'}"]
    whole = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'whole'}"]))
    lines = (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()
    last_val = max(i for i, line in enumerate(lines) if '"val"' in line)
    (tmp_path / "work" / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines[:last_val]))
    again = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'again'}"]))
    assert again.metrics["val_loss"] == pytest.approx(whole.metrics["val_loss"], rel=1e-6)
    assert read_metrics(tmp_path / "again") == read_metrics(tmp_path / "whole")  # the validation logged once


# --- the race against every candidate run to the end, in both worlds (debug=race: about a minute each) -----------

def race_cfg(outputs, *overrides: str):
    from hydra import compose, initialize_config_dir

    import pipelines.regraft  # noqa: F401  (registers every schema, for compose)
    from stages.common.contract.stage import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[f"paths.outputs={outputs}", f"paths.run={outputs / 'run'}",
                                            "launcher=inline", "debug=race", "tracking.enabled=false", *overrides])


def run_race_and_reference(outputs, *overrides: str):
    from rich.console import Console

    from pipelines.launch.make import make_launcher
    from pipelines.modes.race import every_candidate_to_the_end, rung_runner
    from pipelines.pipeline import run_pipeline

    cfg = race_cfg(outputs, *overrides)
    console = Console(quiet=True)
    race = run_pipeline(cfg, outputs / "run", list(overrides), console).summary
    run_rungs = rung_runner(cfg, make_launcher(cfg.launcher, outputs / "jobs"), None, console)
    return race, every_candidate_to_the_end(cfg, run_rungs)


@pytest.fixture(scope="module")
def default_world_race(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("race_default")
    return outputs, *run_race_and_reference(outputs)


@pytest.mark.slow
def test_race_picks_the_full_budget_winner_in_the_default_world_for_under_half_the_compute(default_world_race):
    """B is A trained further: transfer wins, by measured accept_len, as every candidate trained to the end and
    evaluated ranks it; the race spends at most half that compute."""
    _, summary, ranking = default_world_race
    race = summary["race"]
    winner = next(finalist for finalist in race["finalists"] if finalist["candidate"] == race["winner"])
    assert winner["family"] == ranking[0].family == "transfer", (race["decision"], ranking)
    assert race["decided_by"] == "accept_len" and "by measured accept_len" in race["decision"]
    assert race["compute_share"] <= 0.5
    families = {finalist["family"] for finalist in race["finalists"]}
    assert families == {"transfer", "scratch"}  # decided at the full budget, both evaluated
    assert all(finalist["accept_len"] >= 1.0 for finalist in race["finalists"])
    assert all(reference.accept_len >= 1.0 for reference in ranking)


def test_the_race_reports_its_finalists_per_eval_set_and_where_the_loser_wins(default_world_race):
    _, summary, _ = default_world_race
    finalists = summary["race"]["finalists"]
    assert all(set(finalist["per_set"]) == {"prose", "code"} for finalist in finalists)
    for finalist in finalists:
        for name, value in finalist["per_set"].items():
            assert summary["numbers"][f"race/len_{finalist['family']}/{name}"] == value
    winner, rival = finalists
    losing_sets = [name for name in winner["per_set"] if rival["per_set"][name] > winner["per_set"][name]]
    said = summary["race"]["decision"]
    if losing_sets:
        assert f"; {rival['family']} wins on {losing_sets[0]} (" in said, said
    else:
        assert "it wins on every eval set (prose, code)" in said, said


def finalist(init: str, val_loss: float, accept: list[tuple[int, int]]):
    """A finalist whose evaluation answered one turn per conversation: (completion tokens, verify steps) each."""
    from pipelines.modes.race import Candidate, Finalist

    turns = [{"conversation": str(c), "turn": "0", "completion_tokens": str(tokens), "verify_steps": str(steps)}
             for c, (tokens, steps) in enumerate(accept)]
    pooled = sum(tokens for tokens, _ in accept) / sum(steps for _, steps in accept)
    return Finalist(Candidate(init, 1e-3), None, val_loss, 1.5, pooled, {}, turns)


def decided(*finalists):
    from pipelines.modes.race import RaceOutcome, decision

    outcome = RaceOutcome([], list(finalists), 10, 20)  # the finalists come ranked by val loss
    outcome.decide()
    return outcome, decision(outcome, 48)


def test_measured_accept_len_decides_even_against_val_loss():
    """Scratch accepts more on every conversation: it wins, though val loss ranks remap first, and the sentence
    says both figures and that val loss disagrees."""
    remap = finalist("remap", 2.70, [(10, 8)] * 12)
    scratch = finalist("scratch", 2.87, [(13, 8)] * 12)
    outcome, said = decided(remap, scratch)
    assert outcome.winner is scratch and outcome.basis == "accept_len" and not outcome.gap.tie
    assert said.startswith("scratch beats transfer by measured accept_len at the full budget of 48 steps: ")
    assert "accept_len 1.625 vs 1.250 (+0.375, 95% interval +0.375 to +0.375 over 12 paired conversations)" in said
    assert "val loss 2.870 vs 2.700; val loss ranks them the other way" in said


def test_the_decision_names_the_per_request_means_and_when_they_rank_the_other_way():
    """The pooled figure decides; the per-request mean is said beside it, with a note when it would name the other
    finalist (a benchmark averaging per request would), and without one when it agrees."""
    remap = finalist("remap", 2.70, [(10, 8)] * 12)
    scratch = finalist("scratch", 2.87, [(13, 8)] * 12)
    remap.per_request, scratch.per_request = 1.30, 1.60
    _, agrees = decided(remap, scratch)
    assert "; per-request mean 1.600 vs 1.300;" in agrees and "other way)" not in agrees
    remap.per_request = 1.70
    _, differs = decided(remap, scratch)
    assert "; per-request mean 1.600 vs 1.700 (it ranks them the other way)" in differs


def test_accept_len_within_the_noise_is_a_tie_that_val_loss_decides():
    """Two finalists whose conversations go either way: the interval holds 0, val loss decides and the sentence
    says so; the same pair measured far apart is decided by accept_len."""
    ahead = [(14, 8), (8, 8)] * 6
    behind = [(8, 8), (14, 8)] * 6
    outcome, said = decided(finalist("remap", 2.70, behind), finalist("scratch", 2.87, ahead))
    assert outcome.basis == "tie" and outcome.winner.candidate.init == "remap"
    assert "on val loss at the full budget of 48 steps, as their measured accept_len ties" in said
    assert "within the noise" in said
    apart, _ = decided(finalist("remap", 2.70, [(8, 8)] * 12), finalist("scratch", 2.87, [(14, 8)] * 12))
    assert apart.basis == "accept_len" and apart.winner.candidate.init == "scratch"


def test_without_evaluations_val_loss_decides_and_says_why():
    from pipelines.modes.race import Candidate, Finalist

    outcome, said = decided(Finalist(Candidate("remap", 1e-3), None, 2.70, 1.5),
                            Finalist(Candidate("scratch", 1e-3), None, 2.87, 1.4))
    assert outcome.basis == "val_loss" and outcome.winner.candidate.init == "remap"
    assert "(no finalist was evaluated: pipeline.evaluate=false)" in said


def test_the_decision_names_each_set_the_losing_family_wins():
    from pipelines.modes.race import Candidate, Finalist, where_the_rival_wins

    winner = Finalist(Candidate("remap", 1e-3), None, 1.0, 1.5, 1.8, {"chat": 2.0, "code": 1.4})
    rival = Finalist(Candidate("scratch", 1e-3), None, 1.1, 1.4, 1.6, {"chat": 1.5, "code": 1.7})
    assert where_the_rival_wins(winner, rival) == "; scratch wins on code (1.700 vs 1.400)"
    assert where_the_rival_wins(rival, winner) == "; transfer wins on chat (2.000 vs 1.500)"
    assert where_the_rival_wins(winner, Finalist(Candidate("scratch", 1e-3), None, 1.1, 1.4, 1.6,
                                                 {"chat": 1.0, "code": 1.0})) == "; it wins on every eval set (chat, code)"


@pytest.mark.slow
def test_race_picks_the_full_budget_winner_in_the_drifted_world(tmp_path):
    summary, ranking = run_race_and_reference(tmp_path, "world.rotate_b=1")
    race = summary["race"]
    winner = next(finalist for finalist in race["finalists"] if finalist["candidate"] == race["winner"])
    assert winner["family"] == ranking[0].family, (race["decision"], ranking)
    assert race["compute_share"] <= 0.5
    by_loss = sorted(ranking, key=lambda reference: reference.val_loss)
    place = {reference.label: index for index, reference in enumerate(by_loss)}
    best = lambda init: min(index for label, index in place.items() if label.startswith(init))
    # the closed-form re-alignment is what carries the old drafter over: it ends first, ahead of remap and scratch.
    # Whether scratch also passes remap (the Kimi shape) depends on the world: the world before its questions followed
    # each docstring's kind showed it on this seed, this one does not (docs/results.md, figures:drift-seeds)
    assert best("realign") == 0 and best("realign") < min(best("remap"), best("scratch"))


@pytest.mark.long  # two more worlds and source drafters: about 5 minutes a seed on 2 idle cores
@pytest.mark.parametrize("seed", [1, 2])
def test_in_the_drifted_world_of_any_seed_realign_ends_first(tmp_path, seed):
    """What holds beyond seed 0 (with seed 0's race test above, three seeds): every candidate trained to the full
    budget ranks a re-aligned drafter first, ahead of remap and scratch. Whether scratch passes remap depends on the
    seed, so it is not asserted here."""
    from rich.console import Console

    from pipelines.launch.make import make_launcher
    from pipelines.modes.race import every_candidate_to_the_end, rung_runner

    cfg = race_cfg(tmp_path, "world.rotate_b=1", f"world.seed={seed}", "race.lrs=[0.003]")
    ranking = every_candidate_to_the_end(cfg, rung_runner(cfg, make_launcher(cfg.launcher, tmp_path / "jobs"), None,
                                                          Console(quiet=True)))
    assert min(ranking, key=lambda reference: reference.val_loss).label.split()[0] == "realign", ranking


@pytest.mark.slow
def test_a_rerun_runs_nothing_and_one_more_candidate_reuses_every_rung(default_world_race):
    from rich.console import Console

    from pipelines.pipeline import run_pipeline

    outputs, first, _ = default_world_race
    again = run_pipeline(race_cfg(outputs), outputs / "run2", [], Console(quiet=True)).summary
    assert [name for name, stage in again["stages"].items() if not stage["hit"]] == []
    assert again["race"]["winner"] == first["race"]["winner"]
    more = ["race.lrs=[0.001,0.003,0.01]"]
    wider = run_pipeline(race_cfg(outputs, *more), outputs / "run3", more, Console(quiet=True)).summary
    before = {(stage["key"]): name for name, stage in first["stages"].items()}
    reused = [name for name, stage in wider["stages"].items() if stage["key"] in before]
    assert all(wider["stages"][name]["hit"] for name in reused)
    assert any(name.startswith("race_") for name in reused)  # rungs of the earlier candidates, not only the base
    new = [name for name, stage in wider["stages"].items() if not stage["hit"]]
    assert any(name.startswith("race_") and "lr0.01" in name for name in new), new  # only the new lr's rungs train
