"""What a parent run is called and tagged: a sweep member by the values its sweep varies (`lr=1e-3 init=remap`),
a single run by its overrides (or `defaults`) and when it started (`defaults · 12-07 11:24:38`), with the sweep's
tags shared by its children."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

NOT_IN_NAMES = ("paths.", "hydra.", "tracking.")  # overrides that say where, not what is computed


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def override_value(override: str) -> str:
    return override.split("=", 1)[1] if "=" in override else ""


def short_keys(keys: list[str]) -> dict[str, str]:
    """`finetune.lr` -> `lr`, unless another key ends the same way (then both stay whole)."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: short if last.count(short) == 1 else key for key, short in zip(keys, last)}


@dataclass
class Invocation:
    """What a parent run is called, and the tags it shares with its children."""

    name: str
    tags: dict[str, str] = field(default_factory=dict)


def started(run_dir: Path | str | None) -> str | None:
    """When a run started, from its run folder's name (`2026-12-07_11-24-38_<µs>_<pid>` -> `12-07 11:24:38`); None
    for a folder not named so."""
    parts = Path(run_dir).name.split("_") if run_dir else []
    if len(parts) < 2 or len(parts[0]) != 10 or len(parts[1]) != 8:
        return None
    return f"{parts[0][5:]} {parts[1].replace('-', ':')}"


def invocation(overrides: list[str], swept: list[str] | None = None, sweep: str | None = None,
               member: int | None = None, when: str | None = None) -> Invocation:
    """A sweep member is named by its values of the swept keys (`lr=1e-3 init=remap`; its sweep is a tag); a single
    run by its overrides except where-to-write ones, or `defaults`, then `when` it started if given (`defaults ·
    12-07 11:24:38`): single runs of the same overrides are otherwise told apart by nothing but their duration."""
    by_key = {override_key(override): override for override in overrides}
    if swept:
        named = [by_key[key] for key in swept if key in by_key]
    else:
        named = [override for override in overrides if not override_key(override).startswith(NOT_IN_NAMES)]
    short = short_keys([override_key(override) for override in named])
    name = " ".join(f"{short[override_key(o)]}={override_value(o)}" if "=" in o else o for o in named) or "defaults"
    if when and not swept and sweep is None:
        name = f"{name} · {when}"
    tags: dict[str, str] = {}
    if sweep is not None:
        tags.update(sweep=sweep, member=str(member), swept=" ".join(swept or []) or "(nothing varies)")
        tags.update({override_key(o): override_value(o)[:5000] for o in named if swept})
    return Invocation(name[:250], tags)


def swept_keys(task: list[str], params: dict[str, Any] | None = None) -> list[str]:
    """The keys a sweep varies: its command-line overrides with several values (`finetune.lr=1e-3,3e-3`,
    `choice(...)`, `range(...)`), and the sweeper's `params` from the config."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [*task, *(f"{key}={value}" for key, value in (params or {}).items())]
    keys: list[str] = []
    for override in OverridesParser.create().parse_overrides(given):
        if override.is_sweep_override() and override.key_or_group not in keys:
            keys.append(override.key_or_group)
    return keys


def hydra_invocation(overrides: list[str], run_dir: Path | None = None) -> Invocation:
    """This process's invocation as Hydra launched it: a sweep member (its sweep folder, number and the keys the
    sweep varies, read from the sweep's multirun.yaml) or a single run (with when its run folder says it started)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return invocation(overrides, when=started(run_dir))
    hydra = HydraConfig.get()
    sweep_dir = Path(hydra.sweep.dir)
    task, params = [], OmegaConf.to_container(hydra.sweeper.params) if hydra.sweeper.get("params") else {}
    if (sweep_dir / "multirun.yaml").exists():  # the sweep as given: `finetune.lr=1e-3,3e-3`, not this member's value
        given = OmegaConf.load(sweep_dir / "multirun.yaml").hydra
        task = list(given.overrides.task)
        params = OmegaConf.to_container(given.sweeper.params) if given.sweeper.get("params") else params
    return invocation(overrides, swept_keys(task, params), sweep_dir.name, hydra.job.num)
