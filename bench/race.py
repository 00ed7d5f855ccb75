"""The race against its reference: the decision successive halving makes, the ranking every candidate trained to the
full budget gives, and the share of that full compute the race spent, in the default world and the drifted one.

    .venv/bin/python bench/race.py                      # default sizes: both worlds, about 10 minutes
    .venv/bin/python bench/race.py --tiny               # debug=race (tests/test_race.py's sizes): about 2 minutes
    .venv/bin/python bench/race.py --world-override world.rotate_b=1 --budget 48
    .venv/bin/python bench/race.py --tiny --seeds 0,1,2 # the drifted world (rotate_b=1) on three seeds
    .venv/bin/python bench/race.py --tiny --seeds 0,1,2,3,4 --world-override world.b_init=fresh \
        --world-override world.b_style=reversed        # a given world on five seeds
    ... --write NAME                                    # also write the table into the figures:NAME block
                                                        # (README.md or docs/, wherever it stands; alias --readme)

Each world runs `regraft pipeline.race=true` in-process (launcher=inline), then every candidate to the end from
its own checkpoint folder (pipelines/race.py::every_candidate_to_the_end), each of them measured as phase 1 is (the
probe stage on the eval sets: accept_len, the number a drafter is for) beside where it started (the preflight's
step-0 loss, and full_acc_k of its first training batch before any update: fine-tunes here log every step); all
cached in --outputs, so a rerun prints the tables at once.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from pipelines.dag import DIAGNOSE, evaluate_node
from pipelines.launchers import make_launcher
from pipelines.race import base_nodes, candidates, rung_node, rung_runner
from pipelines.pipeline import run_pipeline
from stages.common.contract.stage import CONF_DIR

WORLDS = {"default": [], "drifted": ["world.rotate_b=1"]}
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Measured:
    """One candidate trained to the full budget: its val loss, its measured accept_len, and where it started."""

    label: str
    val_loss: float
    accept_len: float
    per_set: dict[str, float]
    loss_0: float  # the preflight's step-0 loss
    start_acc: list[float]  # full_acc_k of the first training batch, at the init (step 1 is logged before its update)


def race_world(outputs: Path, overrides: list[str], console: Console) -> tuple[dict, list[Measured], dict]:
    overrides = [f"paths.outputs={outputs}", f"paths.run={outputs / 'runs' / 'race'}", "launcher=inline",
                 "pipeline.race=true", "pipeline.probe=false", "finetune.log_every=1", *overrides]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    done = run_pipeline(cfg, outputs / "runs" / "race", overrides, console)
    run_rungs = rung_runner(cfg, make_launcher(cfg.launcher, outputs / "jobs"), None, console)
    measured, diagnosed = every_candidate_measured(cfg, run_rungs)
    return done.summary["race"], sorted(measured, key=lambda m: m.val_loss), diagnosed


def every_candidate_measured(cfg, run_rungs) -> tuple[list[Measured], dict]:
    """pipelines/race.py::every_candidate_to_the_end, each candidate then measured by an evaluate node; and
    diagnose's figures (CKA) for the world."""
    results = run_rungs(base_nodes(cfg), {})
    pool = candidates(cfg)
    whole = [rung_node(cfg, candidate, None, None) for candidate in pool]
    results.update(run_rungs(whole, results))
    probes = [evaluate_node(cfg, f"{node.name}_evaluate", results[node.name].out, "race") for node in whole]
    results.update(run_rungs(probes, results))
    measured = [measure(candidate.label, results[node.name], results[probe.name].metrics)
                for candidate, node, probe in zip(pool, whole, probes)]
    return measured, results[DIAGNOSE].metrics if DIAGNOSE in results else {}


def measure(label: str, trained, probed: dict) -> Measured:
    lines = [json.loads(line) for line in (Path(trained.out) / "metrics.jsonl").read_text().splitlines()]
    preflight = next(line for line in lines if line["split"] == "preflight")
    first = next((line for line in lines if line["split"] == "train" and line["step"] == 1 and "full_acc_0" in line),
                 {})
    return Measured(label, trained.metrics.get("val_loss", math.inf), probed["accept_len"],
                    {key.removeprefix("accept_len/"): value for key, value in probed.items()
                     if key.startswith("accept_len/")},
                    preflight["preflight_loss_0"], [first[f"full_acc_{k}"] for k in range(len(first))
                                                    if f"full_acc_{k}" in first])


def family_of(label: str) -> str:
    """The answer to transfer-or-scratch a candidate label ("remap lr=0.003") stands for."""
    return "scratch" if label.startswith("scratch") else "transfer"


def yes_or_no(agrees: bool, answer: str) -> str:
    return f"yes ({answer})" if agrees else f"NO ({answer})"


def best(ranking: list[tuple[str, float]], init: str) -> float:
    return min(loss for label, loss in ranking if label.split()[0] == init)


def markdown(header: tuple[str, ...], rows: list[tuple[str, ...]], said: str) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n\n" + "\n".join(textwrap.wrap(said, width=118)) + "\n"


def write_block(name: str, block: str) -> None:
    """The `<!-- figures:NAME -->` block, in README.md or the page of docs/ that holds it, replaced by this table."""
    from figures import write_blocks  # bench/figures.py, beside this file

    changed = write_blocks({name: block})
    print(f"figures:{name}: " + (f"{changed[0].relative_to(ROOT)} written" if changed else "unchanged"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=Path, default=Path("outputs/bench_race"))
    parser.add_argument("--tiny", action="store_true", help="debug=race: the tiny world, trained enough to rank")
    parser.add_argument("--budget", type=int, default=None, help="race.budget_steps")
    parser.add_argument("--world-override", action="append", default=None,
                        help="run one world with these overrides instead of the default and drifted ones")
    parser.add_argument("--seeds", help="the drifted world (world.rotate_b=1), or the --world-override one, on these "
                        "world seeds, e.g. 0,1,2")
    parser.add_argument("--write", "--readme", metavar="NAME",
                        help="also write the table into the <!-- figures:NAME --> block of README.md or docs/")
    args = parser.parse_args()
    console = Console(width=120)
    worlds = {"given": args.world_override} if args.world_override else WORLDS
    if args.seeds:
        given = args.world_override or ["world.rotate_b=1"]
        worlds = {f"seed{seed}": [*given, f"world.seed={seed}"] for seed in args.seeds.split(",")}
    common = (["debug=race"] if args.tiny else []) + \
        ([f"race.budget_steps={args.budget}"] if args.budget else [])
    table = Table(title="race vs every candidate to the end (ranked by val loss)", title_justify="left")
    columns = ("world", "race winner", "full-budget ranking (val loss)", "same candidate", "same answer",
               "compute spent")
    for column in columns:
        table.add_column(column)
    rows, shapes, verdicts, every = [], [], [], []
    for name, overrides in worlds.items():
        race, measured, diagnosed = race_world(args.outputs / name, [*common, *overrides], console)
        ranking = [(m.label, m.val_loss) for m in measured]
        verdicts.append(verdict(name, measured, diagnosed))
        every += [candidate_row(name, m) for m in measured]
        console.print(f"{name}: {race['decision']}", highlight=False, soft_wrap=True)
        rows.append((f"{name} (`{' '.join(overrides) or 'defaults'}`)", race["winner"],
                     "; ".join(f"{label} {loss:.3f}" for label, loss in ranking),
                     "yes" if ranking[0][0] == race["winner"] else "NO",
                     yes_or_no(family_of(ranking[0][0]) == family_of(race["winner"]), family_of(race["winner"])),
                     f"{race['steps_spent']} of {race['steps_all_to_the_end']} steps ({race['compute_share']:.0%})"))
        table.add_row(*rows[-1])
        shapes.append((name, *(f"{best(ranking, init):.3f}" for init in ("realign", "remap", "scratch")),
                       "yes" if best(ranking, "scratch") < best(ranking, "remap") else "no"))
    console.print(table)
    for title, header, body in ((MEASURED_TITLE, MEASURED_COLUMNS, every), (VERDICT_TITLE, VERDICT_COLUMNS, verdicts)):
        console.print(rich_table(title, header, body))
    if args.seeds:  # where the Kimi shape holds: scratch ends ahead of remap, realign ahead of both
        shape = Table(title="the drifted world by seed: best val loss per init at the full budget", title_justify="left")
        for column in SHAPE_COLUMNS:
            shape.add_column(column)
        for row in shapes:
            shape.add_row(*row)
        console.print(shape)
    if args.write:
        command = "bench/race.py " + " ".join(arg for arg in sys.argv[1:] if not arg.startswith(("--readme", "--write"))
                                              and arg != args.write)
        from figures import written  # bench/figures.py, beside this file

        said = f"{written(command)}; budget {race['budget_steps']} steps, on 2 cores."
        block = markdown(columns, rows, said) + "\n" + markdown(VERDICT_COLUMNS, verdicts, said)
        if args.seeds:
            block = markdown(SHAPE_COLUMNS, shapes, said) + "\n" + block
        write_block(args.write, block)


SHAPE_COLUMNS = ("world", "realign", "remap", "scratch", "Kimi shape (scratch ahead of remap)")
MEASURED_TITLE = "every candidate at the full budget, measured as phase 1 is"
MEASURED_COLUMNS = ("world", "candidate", "val loss", "accept_len", "per set", "start: loss_0", "start: full_acc_k")
VERDICT_TITLE = "transfer or scratch at the full budget: the finalists (each family's best by val loss), measured"
VERDICT_COLUMNS = ("world", "transfer finalist: val loss / accept_len", "scratch finalist: val loss / accept_len",
                   "by val loss", "by accept_len", "scratch - transfer accept_len", "widest lr spread of one init",
                   "start: remap / scratch full_acc_k", "CKA(A, B)")


def rich_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in header:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def accuracies(values: list[float]) -> str:
    return "/".join(f"{value:.3f}" for value in values) or "-"


def candidate_row(world: str, m: Measured) -> tuple[str, ...]:
    return (world, m.label, f"{m.val_loss:.3f}", f"{m.accept_len:.3f}",
            " ".join(f"{name} {value:.3f}" for name, value in m.per_set.items()), f"{m.loss_0:.3f}",
            accuracies(m.start_acc))


def verdict(world: str, measured: list[Measured], diagnosed: dict) -> tuple[str, ...]:
    """The race's two finalists (`measured` is ranked by val loss), the answer each figure gives, the accept_len
    margin beside the widest gap two lrs of one init leave, and where remap and scratch started."""
    transfer, scratch = (next(m for m in measured if family_of(m.label) == family)
                         for family in ("transfer", "scratch"))
    by_loss = family_of(min((transfer, scratch), key=lambda m: m.val_loss).label)
    by_len = family_of(max((transfer, scratch), key=lambda m: m.accept_len).label)
    inits = {m.label.split()[0] for m in measured}
    spread = max(max(lens) - min(lens) for lens in
                 ([m.accept_len for m in measured if m.label.split()[0] == init] for init in inits))
    start = {init: next(m for m in measured if m.label.startswith(init)) for init in ("remap", "scratch")
             if any(m.label.startswith(init) for m in measured)}
    cka = diagnosed.get("cka_mean")
    return (world, f"{transfer.label}: {transfer.val_loss:.3f} / {transfer.accept_len:.3f}",
            f"{scratch.label}: {scratch.val_loss:.3f} / {scratch.accept_len:.3f}", by_loss, by_len,
            f"{scratch.accept_len - transfer.accept_len:+.3f}", f"{spread:.3f}",
            " vs ".join(accuracies(m.start_acc) for m in start.values()), "-" if cka is None else f"{cka:.3f}")


if __name__ == "__main__":
    main()
