"""A race under one budget: which start wins, transfer (remap, realign) or scratch, at a fraction of running all.

Candidates are `race.inits` x `race.lrs`; each would train `race.budget_steps` optimizer steps (its cosine schedule
is always that long). Successive halving: every candidate trains to the first rung, the best 1/eta by validation
loss (TTT's decay-weighted loss on the held-out split, lower is better: the figure every fine-tune reports, and
the one its best checkpoint is chosen by) continue to the next, and so on; the last one trains to the full budget
and is evaluated like phase 1. Rung r of R ends at `ceil(budget / eta^(R-1-r))` steps.

A rung is a finetune node with `stop_at` = its step and a checkpoint folder shared by the candidate's rungs, so a
promoted candidate resumes from its rung checkpoint and continues exactly as one uninterrupted run would
(tests/test_race.py). Every rung is a cached node like any stage: a finished race reruns nothing; a race with one
more candidate reuses every rung already trained. The pipeline's own rungs instead of Optuna's pruners: the
candidates are a fixed small grid known up front, the decisions are a sort of a few numbers, and each decision
must be a cacheable, deterministic node boundary that survives a kill; Optuna's SuccessiveHalvingPruner decides
inside a running trial from reports in its own storage, which would make the rungs neither cached stage outputs
nor reproducible from the config alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipelines.cache import keys_for
from pipelines.dag import Node, build_nodes, finetune_drafter, wired
from pipelines.runner import NodeResult


@dataclass
class Candidate:
    init: str
    lr: float

    @property
    def name(self) -> str:
        return f"race_{self.init}_lr{self.lr:g}"

    @property
    def label(self) -> str:
        return f"{self.init} lr={self.lr:g}"


@dataclass
class RungRow:
    rung: int
    step: int
    candidate: str
    val_loss: float
    sim_accept_len: float
    promoted: bool = False


def rung_steps(cfg: DictConfig) -> list[int]:
    steps = [math.ceil(cfg.budget_steps / cfg.eta ** (cfg.rungs - 1 - r)) for r in range(cfg.rungs)]
    return sorted(set(steps))


def candidates(cfg: DictConfig) -> list[Candidate]:
    inits = OmegaConf.to_container(cfg.race.inits, enum_to_str=True)  # checked against Init at composition
    return [Candidate(init, float(lr)) for init in inits for lr in cfg.race.lrs]


def base_nodes(cfg: DictConfig) -> list[Node]:
    """Everything a candidate reads (maps, remap, diagnose, features), without the pipeline's own fine-tunes."""
    plain = OmegaConf.merge(cfg, {"pipeline": {"evaluate": False, "baseline": False}})
    if "realign" in OmegaConf.to_container(cfg.race.inits, enum_to_str=True):
        plain.pipeline.diagnose = True
    nodes = [node for node in build_nodes(plain) if node.name != "finetune"]
    return [node for node in nodes if node.name != "probe" or cfg.pipeline.probe]


def rung_node(cfg: DictConfig, candidate: Candidate, stop_at: int | None, checkpoints: str | None) -> Node:
    training = {"features": "@features", "data": None} if cfg.pipeline.offline else {"data": cfg.data.train}
    config = wired(cfg.finetune, target=cfg.target.path, vocab_map="@vocab_map",
                   drafter=finetune_drafter(candidate.init, cfg.source.path), **training)
    config.merge_with({"init": candidate.init, "lr": candidate.lr, "max_steps": cfg.race.budget_steps,
                       "epochs": 10 ** 6, "stop_at": stop_at, "checkpoint_dir": checkpoints,
                       "checkpoint_every": cfg.race.budget_steps})
    if candidate.init == "scratch":
        config.drafter = None
    if cfg.pipeline.offline:
        config.data = None
    return Node(candidate.name if stop_at is None else f"{candidate.name}_step{stop_at}", "finetune", config)


def checkpoint_folder(cfg: DictConfig, base: list[Node], candidate: Candidate) -> str:
    """One folder per candidate, named by its key without a stop: every rung of it resumes there."""
    whole = rung_node(cfg, candidate, None, None)
    key = keys_for(base + [whole])[whole.name]
    return str(Path(cfg.paths.cache) / "race" / key)


@dataclass
class RaceOutcome:
    rows: list[RungRow]
    winner: Candidate
    winner_result: NodeResult
    steps_spent: int
    steps_all: int
    by_candidate: dict[str, RungRow] = field(default_factory=dict)  # each candidate's last rung

    @property
    def compute_share(self) -> float:
        return self.steps_spent / self.steps_all


def survivors(rows: list[RungRow], pool: list[Candidate], eta: int) -> list[Candidate]:
    """The best max(1, n // eta) by validation loss; ties go to the earlier candidate in the grid."""
    loss = {row.candidate: row.val_loss for row in rows}
    ranked = sorted(pool, key=lambda c: (loss[c.label], pool.index(c)))
    return ranked[: max(1, len(pool) // eta)]


def run_race(cfg: DictConfig, run_rungs) -> tuple[list[Node], dict[str, NodeResult], RaceOutcome]:
    """`run_rungs(nodes, done)` runs nodes (given the results so far) and returns their results by name."""
    base = base_nodes(cfg)
    results = run_rungs(base, {})
    pool = candidates(cfg)
    folders = {c.label: checkpoint_folder(cfg, base, c) for c in pool}
    rows: list[RungRow] = []
    nodes = list(base)
    steps = rung_steps(cfg.race)
    reached = {c.label: 0 for c in pool}
    last: dict[str, NodeResult] = {}
    for rung, step in enumerate(steps):
        rung_nodes = [rung_node(cfg, c, step, folders[c.label]) for c in pool]
        done = run_rungs(rung_nodes, results)
        results.update(done)
        nodes += rung_nodes
        for candidate, node in zip(pool, rung_nodes):
            metrics = done[node.name].metrics
            rows.append(RungRow(rung, step, candidate.label, metrics.get("val_loss", math.inf),
                                metrics.get("val_sim_accept_len", math.nan)))
            reached[candidate.label] = step
            last[candidate.label] = done[node.name]
        if rung + 1 < len(steps):
            kept = survivors(rows[-len(pool):], pool, cfg.race.eta)
            for row in rows[-len(pool):]:
                row.promoted = row.candidate in {c.label for c in kept}
            pool = kept
    winner = survivors(rows[-len(pool):], pool, cfg.race.eta)[0]
    for row in rows[-len(pool):]:
        row.promoted = row.candidate == winner.label
    outcome = RaceOutcome(rows, winner, last[winner.label], sum(reached.values()),
                          len(reached) * cfg.race.budget_steps)
    outcome.by_candidate = {label: max((r for r in rows if r.candidate == label), key=lambda r: r.step)
                            for label in reached}
    return nodes, results, outcome


def decision(outcome: RaceOutcome, budget: int) -> str:
    """One sentence: the winner, how it stands against the best of the other family, and what the race cost."""
    winner = outcome.winner
    family = "scratch" if winner.init == "scratch" else f"transfer ({winner.init})"
    rivals = [row for label, row in outcome.by_candidate.items()
              if (label.startswith("scratch")) != (winner.init == "scratch")]
    final = outcome.by_candidate[winner.label]
    text = f"{family} wins: {winner.label}, val loss {final.val_loss:.3f} at the full budget of {budget} steps"
    if rivals:
        best = min(rivals, key=lambda row: row.val_loss)
        mine = next(r for r in outcome.rows if r.candidate == winner.label and r.step == best.step)
        text += (f"; the best {'transfer' if winner.init == 'scratch' else 'scratch'} candidate ({best.candidate}) "
                 f"was {best.val_loss - mine.val_loss:+.3f} behind it at step {best.step}")
    return text + f"; the race spent {outcome.compute_share:.0%} of running all candidates to the end"


def race_table(outcome: RaceOutcome):
    from rich.table import Table

    table = Table(title="race: successive halving by val loss", title_justify="left")
    for column in ("rung", "step", "candidate", "val loss", "sim accept", "on"):
        table.add_column(column, justify="right" if column not in ("candidate", "on") else "left")
    for row in outcome.rows:
        table.add_row(str(row.rung), str(row.step), row.candidate, f"{row.val_loss:.3f}",
                      f"{row.sim_accept_len:.2f}", "yes" if row.promoted else "")
    return table


def race_summary(outcome: RaceOutcome, budget: int) -> dict:
    return {"decision": decision(outcome, budget), "winner": outcome.winner.label,
            "compute_share": outcome.compute_share, "steps_spent": outcome.steps_spent,
            "steps_all_to_the_end": outcome.steps_all, "budget_steps": budget,
            "rungs": [vars(row) for row in outcome.rows]}


def every_candidate_to_the_end(cfg: DictConfig, run_rungs) -> list[tuple[str, float]]:
    """The reference a race answers without paying for it: every candidate trained to the full budget in its own
    checkpoint folder, ranked by the same figure (val loss). For tests and bench/race.py."""
    base = base_nodes(cfg)
    results = run_rungs(base, {})
    whole = [rung_node(cfg, candidate, None, None) for candidate in candidates(cfg)]
    done = run_rungs(whole, results)
    ranking = [(candidate.label, done[node.name].metrics.get("val_loss", math.inf))
               for candidate, node in zip(candidates(cfg), whole)]
    return sorted(ranking, key=lambda item: item[1])
