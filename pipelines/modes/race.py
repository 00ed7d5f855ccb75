"""A race under one budget: which start wins, transfer (remap, realign) or scratch, at a fraction of running all.

Candidates are `race.inits` x `race.lrs`; each would train `race.budget_steps` optimizer steps (its cosine schedule
is always that long). Successive halving: every candidate trains to the first rung, the best 1/eta by validation
loss (TTT's decay-weighted loss on the held-out split, lower is better: the figure every fine-tune reports, and
the one its best checkpoint is chosen by) continue to the next, and so on. Rung r of R ends at
`ceil(budget / eta^(R-1-r))` steps, none inside the warmup. Each family's best (transfer: remap, realign; scratch)
always goes on, so transfer-or-scratch is decided at the full budget, where both finalists are evaluated as phase 1
is (the probe stage on the eval sets). The winner is the finalist with the higher measured accept_len, the number
regraft sells: val loss is scored against the training map, and a vocab or feature mismatch can hide there while
acceptance collapses (SpecForge PR #534). Two finalists whose accept_len differ by less than the measurement's noise
tie (`accept_len_gap`: a paired bootstrap over the conversations both answered, 95%), and the tie falls back to
val loss, saying so; without evaluations (pipeline.evaluate=false) val loss decides. The winner's evaluation is
phase 1.

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
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from pipelines.core.cache import CacheCheck, keys_for
from pipelines.core.dag import PHASE1, PROBE, Node, build_nodes, finetune_node, measurement
from pipelines.core.runner import NodeResult, run_dag


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

    @property
    def family(self) -> str:
        return "scratch" if self.init == "scratch" else "transfer"


@dataclass
class RungRow:
    rung: int
    step: int
    candidate: str
    val_loss: float
    sim_accept_len: float
    promoted: bool = False


def warmup_steps(budget: int, warmup_ratio: float) -> int:
    """Optimizer steps the fine-tune's schedule spends warming up (SpecForge's count, as
    stages/finetune/loop.py::warmup_steps: the fine-tune imports torch, the race's planning does not)."""
    return int(warmup_ratio * budget)


def rung_steps(race: DictConfig, warmup_ratio: float) -> list[int]:
    """Rung r of R at ceil(budget / eta^(R-1-r)), none before two steps past the warmup: a rung inside it would
    rank the starting points, not how the candidates learn."""
    first = min(race.budget_steps, warmup_steps(race.budget_steps, warmup_ratio) + 2)
    steps = [max(first, math.ceil(race.budget_steps / race.eta ** (race.rungs - 1 - r))) for r in range(race.rungs)]
    return sorted(set(steps))


def candidates(cfg: DictConfig) -> list[Candidate]:
    inits = OmegaConf.to_container(cfg.race.inits, enum_to_str=True)  # checked against Init at composition
    return [Candidate(init, float(lr)) for init in inits for lr in cfg.race.lrs]


def base_nodes(cfg: DictConfig) -> list[Node]:
    """Everything a candidate reads (maps, remap, diagnose, features), without the pipeline's own fine-tunes."""
    plain = OmegaConf.merge(cfg, {"pipeline": {"evaluate": False, "baseline": False}})
    if "realign" in OmegaConf.to_container(cfg.race.inits, enum_to_str=True):
        plain.pipeline.diagnose = True
    nodes = [node for node in build_nodes(plain) if node.name != PHASE1.train]
    return [node for node in nodes if node.name != PROBE or cfg.pipeline.probe]


def rung_node(cfg: DictConfig, candidate: Candidate, stop_at: int | None, checkpoints: str | None) -> Node:
    name = candidate.name if stop_at is None else f"{candidate.name}_step{stop_at}"
    return finetune_node(cfg, name, candidate.init, "race", lr=candidate.lr, max_steps=cfg.race.budget_steps,
                         epochs=10 ** 6, stop_at=stop_at, checkpoint_dir=checkpoints,
                         checkpoint_every=cfg.race.budget_steps)


def checkpoint_folder(cfg: DictConfig, base: list[Node], candidate: Candidate) -> str:
    """One folder per candidate, named by its key without a stop: every rung of it resumes there."""
    whole = rung_node(cfg, candidate, None, None)
    key = keys_for(base + [whole])[whole.name]
    return str(Path(cfg.paths.cache) / "race" / key)


@dataclass
class Finalist:
    """A candidate trained to the full budget: the best of its family (transfer or scratch)."""

    candidate: Candidate
    result: NodeResult
    val_loss: float
    sim_accept_len: float
    accept_len: float | None = None  # measured by its evaluate node, when pipeline.evaluate
    per_set: dict[str, float] = field(default_factory=dict)  # its accept_len on each eval set, likewise
    turns: list[dict] = field(default_factory=list)  # its evaluation's rows (per_prompt.csv): the noise's paired draws
    per_request: float | None = None  # the mean of its turns' own accept_len (the pooled figure decides)


@dataclass(frozen=True)
class Gap:
    """One finalist's measured accept_len minus another's over the same conversations, and its 95% interval."""

    difference: float
    low: float
    high: float
    conversations: int

    @property
    def tie(self) -> bool:
        return self.low <= 0 <= self.high

    def __str__(self) -> str:
        return (f"{self.difference:+.3f}, 95% interval {self.low:+.3f} to {self.high:+.3f} over {self.conversations} "
                "paired conversations")


BOOTSTRAP_DRAWS = 2000


def accept_len_gap(ahead: Finalist, behind: Finalist, draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> Gap:
    """`ahead`'s pooled accept_len minus `behind`'s, and its spread: both evaluations asked the same conversations
    (the probe's seeded pick), so conversations are drawn with replacement, the same draw for both, `draws` times,
    and each draw's difference of the pooled ratios (emitted tokens over target forwards) taken; the interval is the
    middle 95% of them. A conversation is the unit because its turns share one context."""
    import random

    def per_conversation(rows: list[dict]) -> dict[str, tuple[int, int]]:
        sums: dict[str, tuple[int, int]] = {}
        for row in rows:
            tokens, steps = sums.get(str(row["conversation"]), (0, 0))
            sums[str(row["conversation"])] = tokens + int(row["completion_tokens"]), steps + int(row["verify_steps"])
        return sums

    mine, theirs = per_conversation(ahead.turns), per_conversation(behind.turns)
    shared = sorted(set(mine) & set(theirs))

    def pooled(sums: dict[str, tuple[int, int]], picked: list[str]) -> float:
        return sum(sums[c][0] for c in picked) / max(sum(sums[c][1] for c in picked), 1)

    generator = random.Random(seed)
    differences = sorted(pooled(mine, draw) - pooled(theirs, draw)
                         for draw in ([generator.choice(shared) for _ in shared] for _ in range(draws)))
    return Gap(pooled(mine, shared) - pooled(theirs, shared), differences[int(0.025 * draws)],
               differences[int(0.975 * draws) - 1], len(shared))


@dataclass
class RaceOutcome:
    rows: list[RungRow]
    finalists: list[Finalist]  # the winner first: by val loss until `decide` ranks them by measured accept_len
    steps_spent: int
    steps_all: int
    basis: str = "val_loss"  # what decided: accept_len, val_loss (not measured), or tie (accept_len within noise)
    gap: Gap | None = None  # the winner's measured accept_len over the rival's

    def decide(self) -> None:
        """The winner by measured accept_len, where every finalist was evaluated; a tie within the noise keeps the
        val-loss order (the finalists come ranked by it)."""
        if len(self.finalists) < 2 or any(f.accept_len is None or not f.turns for f in self.finalists):
            return
        ahead, behind = sorted(self.finalists[:2], key=lambda f: -f.accept_len)
        self.gap = accept_len_gap(ahead, behind)
        if self.gap.tie:
            self.basis = "tie"
            self.gap = accept_len_gap(self.finalists[0], self.finalists[1])
        else:
            self.basis = "accept_len"
            self.finalists = [ahead, behind, *self.finalists[2:]]

    @property
    def winner(self) -> Finalist:
        return self.finalists[0]

    @property
    def compute_share(self) -> float:
        return self.steps_spent / self.steps_all


def ranked(rows: list[RungRow], pool: list[Candidate]) -> list[Candidate]:
    """By validation loss, lowest first; ties go to the earlier candidate in the grid."""
    loss = {row.candidate: row.val_loss for row in rows}
    return sorted(pool, key=lambda c: (loss[c.label], pool.index(c)))


def survivors(rows: list[RungRow], pool: list[Candidate], eta: int) -> list[Candidate]:
    """The best n // eta by validation loss, among them always the best of each family still in the race (so at
    least one per family): the worst kept of a family with several gives way to a missing family's best.

    Early rungs favour a transfer's head start (in the Kimi case the remapped drafter starts lower and plateaus
    below scratch), so transfer-or-scratch itself is decided at the full budget only.
    """
    order = ranked(rows, pool)
    families = list(dict.fromkeys(c.family for c in order))
    kept = order[: max(len(families), len(pool) // eta)]
    for family in families:
        if all(c.family != family for c in kept):
            crowded = [c for c in kept if sum(k.family == c.family for k in kept) > 1]
            kept.remove(crowded[-1])
            kept.append(next(c for c in order if c.family == family))
    return [c for c in order if c in kept]


def run_race(cfg: DictConfig, run_rungs) -> tuple[list[Node], dict[str, NodeResult], RaceOutcome]:
    """`run_rungs(nodes, done)` runs nodes (given the results so far) and returns their results by name."""
    base = base_nodes(cfg)
    results = run_rungs(base, {})
    pool = candidates(cfg)
    folders = {c.label: checkpoint_folder(cfg, base, c) for c in pool}
    rows: list[RungRow] = []
    nodes = list(base)
    steps = rung_steps(cfg.race, cfg.finetune.deepspeed.warmup_ratio)
    reached = {c.label: 0 for c in pool}
    last: dict[str, NodeResult] = {}
    for rung, step in enumerate(steps):
        rung_nodes = [rung_node(cfg, c, step, folders[c.label]) for c in pool]
        done = run_rungs(rung_nodes, results)
        results.update(done)
        nodes += rung_nodes
        rung_rows = []
        for candidate, node in zip(pool, rung_nodes):
            metrics = done[node.name].metrics
            rung_rows.append(RungRow(rung, step, candidate.label, metrics.get("val_loss", math.inf),
                                     metrics.get("val_sim_accept_len", math.nan)))
            reached[candidate.label] = step
            last[candidate.label] = done[node.name]
        rows += rung_rows
        if rung + 1 < len(steps):
            pool = survivors(rung_rows, pool, cfg.race.eta)
        else:  # the finalists: each family's best at the full budget
            pool = [next(c for c in ranked(rung_rows, pool) if c.family == family)
                    for family in dict.fromkeys(c.family for c in ranked(rung_rows, pool))]
        for row in rung_rows:
            row.promoted = row.candidate in {c.label for c in pool}
    by_label = {row.candidate: row for row in rows if row.step == steps[-1]}
    finalists = [Finalist(c, last[c.label], by_label[c.label].val_loss, by_label[c.label].sim_accept_len)
                 for c in pool]
    return nodes, results, RaceOutcome(rows, finalists, sum(reached.values()), len(reached) * cfg.race.budget_steps)


def decision(outcome: RaceOutcome, budget: int) -> str:
    """One sentence: the winner and what decided it (measured accept_len, or val loss in a tie or unmeasured), both
    figures beside, whether val loss would have ranked them the other way, and what the race cost."""
    winner = outcome.winner
    family = "scratch" if winner.candidate.family == "scratch" else f"transfer ({winner.candidate.init})"
    if len(outcome.finalists) == 1:
        text = (f"{family} wins: {winner.candidate.label}, val loss {winner.val_loss:.3f} at the full budget of "
                f"{budget} steps (race.inits has no {'transfer' if family == 'scratch' else 'scratch'} candidate)")
        return text + f"; the race spent {outcome.compute_share:.0%} of running all candidates to the end"
    rival = outcome.finalists[1]
    pair = f"{winner.candidate.label} vs {rival.candidate.label}"
    losses = f"val loss {winner.val_loss:.3f} vs {rival.val_loss:.3f}"
    if outcome.basis == "accept_len":
        text = (f"{family} beats {rival.candidate.family} by measured accept_len at the full budget of {budget} "
                f"steps: {pair}, accept_len {winner.accept_len:.3f} vs {rival.accept_len:.3f} ({outcome.gap}), "
                f"{losses}")
        if winner.val_loss > rival.val_loss:
            text += "; val loss ranks them the other way"
        text += per_request_said(winner, rival)
        text += where_the_rival_wins(winner, rival)
    elif outcome.basis == "tie":
        text = (f"{family} beats {rival.candidate.family} on val loss at the full budget of {budget} steps, as their "
                f"measured accept_len ties: {pair}, accept_len {winner.accept_len:.3f} vs {rival.accept_len:.3f} "
                f"({outcome.gap}: within the noise), {losses}")
    else:
        text = (f"{family} beats {rival.candidate.family} on val loss at the full budget of {budget} steps "
                f"(no finalist was evaluated: pipeline.evaluate=false): {pair}, {losses}, sim accept_len "
                f"{winner.sim_accept_len:.3f} vs {rival.sim_accept_len:.3f}")
    return text + f"; the race spent {outcome.compute_share:.0%} of running all candidates to the end"


def per_request_said(winner: Finalist, rival: Finalist) -> str:
    """The per-request means beside the pooled figures, and whether they rank the finalists the other way (a
    benchmark that averages per-request acceptance would then name the other family)."""
    if winner.per_request is None or rival.per_request is None:
        return ""
    said = f"; per-request mean {winner.per_request:.3f} vs {rival.per_request:.3f}"
    return said + (" (it ranks them the other way)" if rival.per_request > winner.per_request else "")


def where_the_rival_wins(winner: Finalist, rival: Finalist) -> str:
    """The eval sets on which the losing family accepts more, if any (a transfer can win on chat, lose on code)."""
    shared = [name for name in winner.per_set if name in rival.per_set]
    if len(shared) < 2:
        return ""
    better = [name for name in shared if rival.per_set[name] > winner.per_set[name]]
    if not better:
        return f"; it wins on every eval set ({', '.join(shared)})"
    return "; " + rival.candidate.family + " wins on " + ", ".join(
        f"{name} ({rival.per_set[name]:.3f} vs {winner.per_set[name]:.3f})" for name in better)


def race_table(outcome: RaceOutcome):
    from rich.table import Table

    table = Table(title="race: successive halving by val loss; the finalists by measured accept_len",
                  title_justify="left")
    for column in ("rung", "step", "candidate", "val loss", "sim accept", "on"):
        table.add_column(column, justify="right" if column not in ("candidate", "on") else "left")
    last = max(row.rung for row in outcome.rows)
    for row in outcome.rows:
        on = ("winner" if row.candidate == outcome.winner.candidate.label else "final") if row.rung == last else "yes"
        table.add_row(str(row.rung), str(row.step), row.candidate, f"{row.val_loss:.3f}",
                      f"{row.sim_accept_len:.2f}", on if row.promoted else "")
    return table


def race_summary(outcome: RaceOutcome, budget: int) -> dict:
    gap = None if outcome.gap is None else vars(outcome.gap)
    return {"decision": decision(outcome, budget), "winner": outcome.winner.candidate.label,
            "decided_by": outcome.basis, "accept_len_gap": gap,
            "finalists": [{"candidate": f.candidate.label, "family": f.candidate.family, "val_loss": f.val_loss,
                           "sim_accept_len": f.sim_accept_len, "accept_len": f.accept_len,
                           "accept_len_per_request": f.per_request, "per_set": f.per_set}
                          for f in outcome.finalists],
            "compute_share": outcome.compute_share, "steps_spent": outcome.steps_spent,
            "steps_all_to_the_end": outcome.steps_all, "budget_steps": budget,
            "rungs": [vars(row) for row in outcome.rows]}


def rung_runner(cfg: DictConfig, launcher, tracker, console) -> Callable:
    """`run_rungs(nodes, done)`: run more nodes of a DAG that grows rung by rung, each keyed among all so far."""
    every: list[Node] = []

    def run_rungs(nodes: list[Node], done: dict[str, NodeResult]) -> dict[str, NodeResult]:
        every.extend(nodes)
        return run_dag(nodes, Path(cfg.paths.cache), launcher, tracker, console, cfg.launcher.poll_s,
                       cfg.launcher.max_parallel, keys_for(every), done, check=CacheCheck.of(cfg.cache))

    return run_rungs


@dataclass(frozen=True)
class Reference:
    """A candidate trained to the full budget in its own folder: its val loss and, evaluated, its accept_len."""

    label: str
    val_loss: float
    accept_len: float | None
    per_set: dict[str, float] = field(default_factory=dict)  # its accept_len on each eval set
    out: str = ""  # the fine-tune's output (its metrics.jsonl: where it started)

    @property
    def family(self) -> str:
        return "scratch" if self.label.startswith("scratch") else "transfer"


def every_candidate_to_the_end(cfg: DictConfig, run_rungs) -> list[Reference]:
    """The reference a race answers without paying for it: every candidate trained to the full budget in its own
    checkpoint folder and evaluated as phase 1 is (pipeline.evaluate), ranked as the race decides: by measured
    accept_len, highest first (by val loss where nothing was evaluated). For tests and bench/race.py."""
    base = base_nodes(cfg)
    results = run_rungs(base, {})
    whole = [rung_node(cfg, candidate, None, None) for candidate in candidates(cfg)]
    done = run_rungs(whole, results)
    measured: dict[str, dict] = {node.name: {} for node in whole}
    if cfg.pipeline.evaluate:
        evaluations = {node.name: measurement(cfg, f"{node.name}_evaluate", done[node.name].out, "race")
                       for node in whole}
        evaluated = run_rungs([node for nodes in evaluations.values() for node in nodes], {**results, **done})
        measured = {name: evaluated[nodes[-1].name].metrics for name, nodes in evaluations.items()}
    references = [Reference(candidate.label, done[node.name].metrics.get("val_loss", math.inf),
                            measured[node.name].get("accept_len"),
                            {key.removeprefix("accept_len/"): value for key, value in measured[node.name].items()
                             if key.startswith("accept_len/")}, done[node.name].out)
                  for candidate, node in zip(candidates(cfg), whole)]
    if all(reference.accept_len is not None for reference in references):
        return sorted(references, key=lambda reference: (-reference.accept_len, reference.val_loss))
    return sorted(references, key=lambda reference: reference.val_loss)
