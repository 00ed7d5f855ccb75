"""The race against its reference: the decision successive halving makes (by the finalists' measured accept_len),
every candidate trained to the full budget and measured as phase 1 is, ranked the same way with val loss beside,
and the share of that full compute the race spent; per world kind and seed.

    .venv/bin/python bench/race.py                      # default sizes: the default and drifted worlds, seed 0
    .venv/bin/python bench/race.py --tiny               # debug=race (tests/test_race.py's sizes)
    .venv/bin/python bench/race.py --tiny --seeds 0,1,2,3,4 --kind default= \
        --kind fresh=world.b_init=fresh,world.b_style=words_reversed   # both kinds on five seeds
    .venv/bin/python bench/race.py --world-override world.rotate_b=1 --budget 48   # one given world
    ... --write NAME                                    # also write the tables into the figures:NAME block
                                                        # (README.md or docs/, wherever it stands; alias --readme)

Each world runs `regraft pipeline.race=true` in-process (launcher=inline), then every candidate to the end from its
own checkpoint folder and evaluated (pipelines/modes/race.py::every_candidate_to_the_end) beside where it started (the
preflight's step-0 loss, and full_acc_k of its first training batch before any update: fine-tunes here log every
step); all cached in --outputs, so a rerun prints the tables at once. Columns of the main table: whether the race
picked the family (right family) and the candidate (right candidate) the full budget ranks first by accept_len,
and whether val loss at the full budget names the same family as accept_len (val loss agrees).
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from pipelines.core.dag import DIAGNOSE
from pipelines.launch.make import make_launcher
from pipelines.modes.race import Reference, every_candidate_to_the_end, rung_runner
from pipelines.pipeline import run_pipeline
from stages.common.contract.stage import CONF_DIR

KINDS = {"default": [], "drifted": ["world.rotate_b=1"]}
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
    """The race's summary, every candidate at the full budget (first by measured accept_len) and diagnose's
    figures."""
    overrides = [f"paths.outputs={outputs}", f"paths.run={outputs / 'runs' / 'race'}", "launcher=inline",
                 "pipeline.race=true", "pipeline.probe=false", "finetune.log_every=1", *overrides]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    done = run_pipeline(cfg, outputs / "runs" / "race", overrides, console)
    run_rungs = rung_runner(cfg, make_launcher(cfg.launcher, outputs / "jobs"), None, console)
    measured = [measure(reference) for reference in every_candidate_to_the_end(cfg, run_rungs)]
    diagnosed = done.summary["stages"].get(DIAGNOSE, {}).get("metrics", {})
    return done.summary["race"], measured, diagnosed


def measure(reference: Reference) -> Measured:
    lines = [json.loads(line) for line in (Path(reference.out) / "metrics.jsonl").read_text().splitlines()]
    preflight = next(line for line in lines if line["split"] == "preflight")
    first = next((line for line in lines if line["split"] == "train" and line["step"] == 1 and "full_acc_0" in line),
                 {})
    return Measured(reference.label, reference.val_loss, reference.accept_len, reference.per_set,
                    preflight["preflight_loss_0"], [first[f"full_acc_{k}"] for k in range(len(first))
                                                    if f"full_acc_{k}" in first])


def family_of(label: str) -> str:
    """The answer to transfer-or-scratch a candidate label ("remap lr=0.003") stands for."""
    return "scratch" if label.startswith("scratch") else "transfer"


def yes_or_no(agrees: bool, answer: str) -> str:
    return f"yes ({answer})" if agrees else f"NO ({answer})"


def best(measured: list[Measured], init: str) -> float:
    return min(m.val_loss for m in measured if m.label.split()[0] == init)


def race_row(world: str, race: dict, measured: list[Measured]) -> tuple[str, ...]:
    """The race's answer against the full budget's (`measured`, first by accept_len) and val loss's."""
    top, by_loss = measured[0], min(measured, key=lambda m: m.val_loss)
    return (world, f"{race['winner']} ({race['decided_by'].replace('_', ' ')})",
            f"{top.label}: {top.accept_len:.3f} (val loss {top.val_loss:.3f})",
            yes_or_no(family_of(top.label) == family_of(race["winner"]), family_of(race["winner"])),
            "yes" if top.label == race["winner"] else "no",
            yes_or_no(family_of(by_loss.label) == family_of(top.label), family_of(by_loss.label)),
            f"{race['steps_spent']} of {race['steps_all_to_the_end']} steps ({race['compute_share']:.0%})")


def kinds_of(args: argparse.Namespace) -> dict[str, list[str]]:
    """The world kinds to run: --kind NAME=OVERRIDE,OVERRIDE (repeatable), one --world-override world, or both
    default kinds."""
    if args.kind:
        return {name: [item for item in overrides.split(",") if item]
                for name, _, overrides in (kind.partition("=") for kind in args.kind)}
    return {"given": args.world_override} if args.world_override else KINDS


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
    parser.add_argument("--kind", action="append", default=None, metavar="NAME=OVERRIDE,...",
                        help="a world kind and its overrides (repeatable; NAME= for the default world)")
    parser.add_argument("--world-override", action="append", default=None,
                        help="run one world with these overrides instead of the default and drifted ones")
    parser.add_argument("--seeds", help="every kind on these world seeds, e.g. 0,1,2,3,4 (default: its own seed)")
    parser.add_argument("--write", "--readme", metavar="NAME",
                        help="also write the tables into the <!-- figures:NAME --> block of README.md or docs/")
    args = parser.parse_args()
    console = Console(width=120)
    seeds = args.seeds.split(",") if args.seeds else [None]
    worlds = {(f"{kind} seed {seed}" if seed is not None else kind): [*overrides] + ([f"world.seed={seed}"] if seed
                                                                                   is not None else [])
              for kind, overrides in kinds_of(args).items() for seed in seeds}
    common = (["debug=race"] if args.tiny else []) + ([f"race.budget_steps={args.budget}"] if args.budget else [])
    rows, shapes, verdicts, every = [], [], [], []
    for name, overrides in worlds.items():
        race, measured, diagnosed = race_world(args.outputs / name.replace(" ", "_"), [*common, *overrides], console)
        console.print(f"{name}: {race['decision']}", highlight=False, soft_wrap=True)
        rows.append(race_row(name, race, measured))
        verdicts.append(verdict(name, sorted(measured, key=lambda m: m.val_loss), diagnosed))
        every += [candidate_row(name, m) for m in measured]
        shapes.append((name, *(f"{best(measured, init):.3f}" for init in ("realign", "remap", "scratch")),
                       "yes" if best(measured, "scratch") < best(measured, "remap") else "no"))
    tables = [(RACE_TITLE, RACE_COLUMNS, rows), (MEASURED_TITLE, MEASURED_COLUMNS, every),
              (VERDICT_TITLE, VERDICT_COLUMNS, verdicts), (SHAPE_TITLE, SHAPE_COLUMNS, shapes)]
    for title, header, body in tables:
        console.print(rich_table(title, header, body))
    if args.write:
        command = "bench/race.py " + " ".join(arg for arg in sys.argv[1:] if not arg.startswith(("--readme", "--write"))
                                              and arg != args.write)
        from figures import written  # bench/figures.py, beside this file

        said = f"{written(command)}; budget {race['budget_steps']} steps, on 2 cores."
        write_block(args.write, "\n".join(markdown(header, body, said) for title, header, body in tables
                                          if title != MEASURED_TITLE))


RACE_TITLE = "the race vs every candidate at the full budget, ranked by measured accept_len"
RACE_COLUMNS = ("world", "race winner (decided by)", "full budget: first by accept_len", "right family",
                "right candidate", "val loss agrees", "compute spent")
SHAPE_TITLE = "best val loss per init at the full budget"
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
