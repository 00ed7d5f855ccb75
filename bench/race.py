"""The race against its reference: the decision successive halving makes, the ranking every candidate trained to the
full budget gives, and the share of that full compute the race spent, in the default world and the drifted one.

    .venv/bin/python bench/race.py                      # default sizes: both worlds, about 10 minutes
    .venv/bin/python bench/race.py --tiny               # debug=race (tests/test_race.py's sizes): about 2 minutes
    .venv/bin/python bench/race.py --world-override world.rotate_b=1 --budget 48
    .venv/bin/python bench/race.py --tiny --seeds 0,1,2 # the drifted world (rotate_b=1) on three seeds
    ... --write NAME                                    # also write the table into the figures:NAME block
                                                        # (README.md or docs/, wherever it stands; alias --readme)

Each world runs `regraft pipeline.race=true` in-process (launcher=inline), then every candidate to the end from
its own checkpoint folder (pipelines/race.py::every_candidate_to_the_end); both are cached in --outputs, so a
rerun prints the table at once.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from pipelines.launchers import make_launcher
from pipelines.race import every_candidate_to_the_end, rung_runner
from pipelines.pipeline import run_pipeline
from stages.common.contract.stage import CONF_DIR

WORLDS = {"default": [], "drifted": ["world.rotate_b=1"]}
ROOT = Path(__file__).resolve().parents[1]


def race_world(outputs: Path, overrides: list[str], console: Console) -> tuple[dict, list[tuple[str, float]]]:
    overrides = [f"paths.outputs={outputs}", f"paths.run={outputs / 'runs' / 'race'}", "launcher=inline",
                 "pipeline.race=true", "pipeline.probe=false", *overrides]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    done = run_pipeline(cfg, outputs / "runs" / "race", overrides, console)
    run_rungs = rung_runner(cfg, make_launcher(cfg.launcher, outputs / "jobs"), None, console)
    return done.summary["race"], every_candidate_to_the_end(cfg, run_rungs)


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
    parser.add_argument("--seeds", help="the drifted world (world.rotate_b=1) on these world seeds, e.g. 0,1,2")
    parser.add_argument("--write", "--readme", metavar="NAME",
                        help="also write the table into the <!-- figures:NAME --> block of README.md or docs/")
    args = parser.parse_args()
    console = Console(width=120)
    worlds = {"given": args.world_override} if args.world_override else WORLDS
    if args.seeds:
        worlds = {f"seed{seed}": ["world.rotate_b=1", f"world.seed={seed}"] for seed in args.seeds.split(",")}
    common = (["debug=race"] if args.tiny else []) + \
        ([f"race.budget_steps={args.budget}"] if args.budget else [])
    table = Table(title="race vs every candidate to the end (ranked by val loss)", title_justify="left")
    columns = ("world", "race winner", "full-budget ranking (val loss)", "same candidate", "same answer",
               "compute spent")
    for column in columns:
        table.add_column(column)
    rows, shapes = [], []
    for name, overrides in worlds.items():
        race, ranking = race_world(args.outputs / name, [*common, *overrides], console)
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
        block = markdown(columns, rows, said)
        if args.seeds:
            block = markdown(SHAPE_COLUMNS, shapes, said) + "\n" + block
        write_block(args.write, block)


SHAPE_COLUMNS = ("world", "realign", "remap", "scratch", "Kimi shape (scratch ahead of remap)")


if __name__ == "__main__":
    main()
