"""The race against its reference: the decision successive halving makes, the ranking every candidate trained to the
full budget gives, and the share of that full compute the race spent, in the default world and the drifted one.

    .venv/bin/python bench/race.py                      # default sizes: both worlds, about 10 minutes
    .venv/bin/python bench/race.py --tiny               # debug=race (tests/test_race.py's sizes): about 2 minutes
    .venv/bin/python bench/race.py --world-override world.rotate_b=1 --budget 48

Each world runs `regraft pipeline.race=true` in-process (launcher=inline), then every candidate to the end from
its own checkpoint folder (pipelines/race.py::every_candidate_to_the_end); both are cached in --outputs, so a
rerun prints the table at once.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from pipelines.launchers import make_launcher
from pipelines.race import every_candidate_to_the_end, rung_runner
from pipelines.regraft import run_pipeline
from stages.common.stage import CONF_DIR

WORLDS = {"default": [], "drifted": ["world.rotate_b=1"]}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=Path, default=Path("outputs/bench_race"))
    parser.add_argument("--tiny", action="store_true", help="debug=race: the tiny world, trained enough to rank")
    parser.add_argument("--budget", type=int, default=None, help="race.budget_steps")
    parser.add_argument("--world-override", action="append", default=None,
                        help="run one world with these overrides instead of the default and drifted ones")
    args = parser.parse_args()
    console = Console(width=120)
    worlds = {"given": args.world_override} if args.world_override else WORLDS
    common = (["debug=race"] if args.tiny else []) + \
        ([f"race.budget_steps={args.budget}"] if args.budget else [])
    table = Table(title="race vs every candidate to the end (ranked by val loss)", title_justify="left")
    columns = ("world", "race winner", "full-budget ranking (val loss)", "same candidate", "same answer",
               "compute spent")
    for column in columns:
        table.add_column(column)
    for name, overrides in worlds.items():
        race, ranking = race_world(args.outputs / name, [*common, *overrides], console)
        console.print(f"{name}: {race['decision']}", highlight=False, soft_wrap=True)
        table.add_row(name, race["winner"], "; ".join(f"{label} {loss:.3f}" for label, loss in ranking),
                      "yes" if ranking[0][0] == race["winner"] else "NO",
                      yes_or_no(family_of(ranking[0][0]) == family_of(race["winner"]), family_of(race["winner"])),
                      f"{race['steps_spent']} of {race['steps_all_to_the_end']} steps ({race['compute_share']:.0%})")
    console.print(table)


if __name__ == "__main__":
    main()
