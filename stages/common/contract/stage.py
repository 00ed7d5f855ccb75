"""What a stage is, for everything that runs one: its result, its typed config, and its command line.

A stage is a module under stages/ with a config dataclass registered here (`register_schema`, which makes
`conf/NAME/*.yaml` typed) and `run(cfg) -> StageResult`: an output folder, metrics and a one-line headline. It knows
nothing of the cache, the DAG or MLflow (pipelines/ does). `python -m stages.NAME key=value ...` composes
`conf/NAME/default.yaml` with Hydra's override grammar (`stage_main`): composition errors (a typo in a key, a bad
value) exit 2 with Hydra's message; bad input exits 1 with one RegraftError line; success prints the stage's table.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, get_type_hints

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.table import Table

from stages.common.contract.errors import RegraftError

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


@dataclass
class StageResult:
    """What a stage hands back: its output folder, its metrics, and a one-line headline."""

    out: Path
    metrics: dict[str, float] = field(default_factory=dict)
    headline: str = ""


ConfigCheck = Callable[[DictConfig, str], None]  # (config, its dotted place) -> None, or RegraftError
CHECKS: dict[type, ConfigCheck] = {}
SCHEMAS: dict[str, type] = {}  # stage -> its config's schema, for checks of a node's own config


def register_schema(stage: str, schema: type, check: ConfigCheck | None = None) -> None:
    """Make `conf/STAGE/*.yaml` typed: their defaults list pulls `/schema/STAGE@_here_`. `check` holds the rules
    that tie fields together (per-field bounds are `setting`s), run by `check_config`."""
    ConfigStore.instance().store(group="schema", name=stage, node=schema)
    SCHEMAS[stage] = schema
    if check is not None:
        CHECKS[schema] = check


def setting(default: Any, *, above: float | None = None, at_least: float | None = None,
            at_most: float | None = None, below: float | None = None) -> Any:
    """A schema field with the values it may take: `lr: float = setting(1e-4, above=0)`. Types are Hydra's to
    check at composition; bounds are `check_config`'s, before any work starts."""
    bounds = {"above": above, "at_least": at_least, "at_most": at_most, "below": below}
    return field(default=default, metadata={"bounds": {k: v for k, v in bounds.items() if v is not None}})


BOUND_WORDS = {"above": (">", lambda v, b: v > b), "at_least": (">=", lambda v, b: v >= b),
               "at_most": ("<=", lambda v, b: v <= b), "below": ("<", lambda v, b: v < b)}


def check_config(cfg: DictConfig, schema: type, where: str) -> None:
    """Every bound and cross-field rule of `schema` (and its nested schemas) on `cfg`; the first broken one is a
    RegraftError naming the setting as a user writes it (`finetune.lr=-1`) and the fix."""
    types = get_type_hints(schema)
    for spec in fields(schema):
        bounds, nested = spec.metadata.get("bounds", {}), types[spec.name]
        is_schema = isinstance(nested, type) and is_dataclass(nested)
        if not bounds and not is_schema:
            continue  # never resolved here: some values only resolve inside a running app (paths.run)
        value = cfg.get(spec.name) if spec.name in cfg else None
        key = f"{where}.{spec.name}" if where else spec.name
        for bound, limit in bounds.items():
            word, holds = BOUND_WORDS[bound]
            if isinstance(value, (int, float)) and not holds(value, limit):
                raise RegraftError(f"{key}={value}", f"must be {word} {limit:g}", f"set {key}= to a value {word} {limit:g}")
        if is_schema and OmegaConf.is_config(value):
            check_config(value, nested, key)
    if schema in CHECKS:
        CHECKS[schema](cfg, where)


def compose_stage(stage: str, overrides: list[str], option: str = "default") -> DictConfig:
    """`conf/STAGE/OPTION.yaml` with Hydra overrides; also from inside a running Hydra app (the pipeline). Its
    schema (stages/schemas/STAGE.py) is registered first, which the option's defaults list pulls."""
    importlib.import_module(f"stages.schemas.{stage}")
    global_hydra = GlobalHydra.instance()
    running = global_hydra.hydra if global_hydra.is_initialized() else None
    global_hydra.clear()
    try:
        with initialize_config_dir(str(CONF_DIR / stage), version_base="1.3"):
            return compose(option, overrides=overrides)
    finally:
        if running is not None:
            GlobalHydra.instance().initialize(running)


def stage_defaults(stage: str) -> DictConfig:
    """`conf/STAGE/default.yaml` as `compose_stage(stage, [])` gives it, built without Hydra where its defaults list
    is only its schema and itself (every stage's is): the schema's defaults, then the file's own values. A Hydra
    compose costs about half a second, and the pipeline asks for stage defaults on every command (dag.py)."""
    importlib.import_module(f"stages.schemas.{stage}")
    raw = OmegaConf.load(CONF_DIR / stage / "default.yaml")
    if list(raw.get("defaults", [])) != [f"/schema/{stage}@_here_", "_self_"]:
        return compose_stage(stage, [])
    config = OmegaConf.merge(OmegaConf.structured(SCHEMAS[stage]),
                             {key: value for key, value in raw.items() if key != "defaults"})
    OmegaConf.set_struct(config, True)
    return config


def render_result(stage: str, result: StageResult, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"{stage}: {result.headline}" if result.headline else stage)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.metrics.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    console.print(f"output: {result.out}")


def stage_main(stage: str, run: Callable[[DictConfig], StageResult], argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(f"usage: python -m stages.{stage} key=value ...\n\ndefaults (conf/{stage}/default.yaml):")
        print(OmegaConf.to_yaml(compose_stage(stage, [])))
        return 0
    try:
        cfg = compose_stage(stage, overrides)
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise RegraftError(f"conf/{stage}/default.yaml", f"no value for {', '.join(missing)}",
                               f"pass {' '.join(k + '=...' for k in missing)}")
        check_config(cfg, OmegaConf.get_type(cfg), "")
        result = run(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except RegraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    render_result(stage, result)
    return 0
