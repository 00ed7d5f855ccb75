"""A config that does not compose, as regraft's one line: the override, and the values or type its key takes.

Hydra reports a bad override in its own words, over several lines, ending with a hint about HYDRA_FULL_ERROR;
`composition_error` turns the exception behind that report into a RegraftError:

    launcher=slurmm        -> launcher=slurmm: not an option of launcher (fix: choose one of inline, local, slurm: ...)
    finetune.lr=abc        -> finetune.lr=abc: finetune.lr takes a float > 0 (fix: e.g. finetune.lr=0.003)
    finetune.lrr=1         -> finetune.lrr=1: finetune has no setting lrr (fix: finetune.lr? ...)
    finetune.lr=[          -> finetune.lr=[: not an override Hydra can read (...) (fix: ...)
    deepspeed.zero_stage=5 -> ...: the config has no setting deepspeed (fix: finetune.deepspeed.zero_stage=5? ...)

It says the same of a mapping of a stage's settings that the stage's schema refuses once composed (the built-in
source drafter's `source.build.finetune`, pipelines/core/dag.py): source.build.finetune.lr=abc -> ... takes a float > 0.

A field's type is its schema's (pipelines/schema.py, each stage's config dataclass), bounds included (`setting`);
a group's options are what Hydra finds for it (the files under conf/<group>/).
"""
from __future__ import annotations

import difflib
import re
import traceback
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Mapping

import hydra
from hydra.core.config_loader import ConfigLoader
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import (ConfigAttributeError, ConfigKeyError, InterpolationResolutionError, OmegaConfBaseException,
                              ValidationError)

from stages.common.engines.credentials import is_secret_name
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import BOUND_WORDS, CONF_DIR, SCHEMAS

GRAMMAR_FIX = "write key=value; quote a value with brackets, commas or spaces: key='...'"
HYDRA_CODE = Path(hydra.__file__).parent
ALL_KEYS_LISTED = 12  # a schema with more keys than this is pointed to (`--cfg job --package`), not listed


def composition_error(exc: BaseException) -> RegraftError:
    """The one line for whatever Hydra raised while composing the config (or a sweep member's)."""
    if isinstance(exc, OverrideParseException):
        return unreadable_override(exc)
    if isinstance(exc, MissingConfigException) and exc.options and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return missing_option(group, option, list(exc.options))
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, InterpolationResolutionError) and getattr(cause, "full_key", None):
        return RegraftError(cause.full_key, one_line(cause.msg))  # the interpolation, and why it does not resolve
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(cause, "full_key", None):
        return unknown_key(cause, given_override(exc, cause))
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        return wrong_value(cause)
    if isinstance(exc, (OmegaConfBaseException, HydraException, ValueError)):
        return RegraftError(None, one_line(exc))  # Hydra's own words, which say what to write instead
    return RegraftError(None, f"Hydra could not compose the config ({type(exc).__name__}: {one_line(exc)})",
                        "check the overrides: group=option for a config group (`regraft --help` lists them), "
                        "key=value for a setting")


def is_composition_failure(exc: BaseException) -> bool:
    """An error of Hydra's or OmegaConf's, or one raised in Hydra's own code (its command line's checks): the
    command line's fault, not a crash of regraft's. A failed write (OSError) is not one, wherever it happened."""
    if isinstance(exc, (HydraException, OmegaConfBaseException)):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return (isinstance(exc, Exception) and not isinstance(exc, OSError) and bool(frames)
            and Path(frames[-1].filename).is_relative_to(HYDRA_CODE))


def unreadable_override(exc: OverrideParseException) -> RegraftError:
    reason = one_line(exc.message).split(" See https://")[0]
    return RegraftError(hidden(exc.override), f"not an override Hydra can read ({reason})", GRAMMAR_FIX)


def hidden(override: str) -> str:
    """An override as the error line shows it: the value left out where the key is named like a secret (a key
    given under a misspelled name must not reach the terminal either)."""
    key, equals, _ = override.partition("=")
    return f"{key}=<hidden>" if equals and is_secret_name(key.rsplit(".", 1)[-1].lstrip("+~")) else override


def missing_option(group: str, option: str, options: list[str]) -> RegraftError:
    """`group=option` names no config of the group: its options, and the folder they are in when it is regraft's."""
    where = f": the files in conf/{group}/" if (CONF_DIR / group).is_dir() else ""
    return RegraftError(f"{group}={option}", f"not an option of {group}",
                        f"choose one of {', '.join(sorted(options))}{where}")


def unknown_key(cause: OmegaConfBaseException, override: str) -> RegraftError:
    """A key its parent does not have: the close names it does have, or where the whole dotted key lives (a group
    placed under another's package: `deepspeed.zero_stage` is `finetune.deepspeed.zero_stage`). A mapping takes
    new keys with `+`: said for a key it takes (its field's `settings_of` schema has it), or any key when it says
    nothing of what it takes and holds no close one."""
    parent, _, key = cause.full_key.rpartition(".")
    mapping = parent and setting_schema(cause) is None
    schema = setting_schema(cause) or mapping_takes(cause)
    names = field_names(schema) if schema is not None else setting_names(cause)
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    if mapping and (key in names if schema is not None else not close):
        return RegraftError(hidden(override), f"{parent} has no setting {key} yet",
                            f"{hidden('+' + override.lstrip('+'))} adds it")
    dotted = [f"{parent}.{name}" if parent else name for name in close]
    given, equals, value = override.lstrip("+").partition("=")
    dotted += [f"{path}{equals}{value}" for path in placed_elsewhere(cause, given)]
    package = stage_of(schema) or parent
    if len(names) <= ALL_KEYS_LISTED:
        listed = f"its settings: {', '.join(names)}"
    else:
        listed = f"`regraft --cfg job{f' --package {package}' if package else ''}` lists every one"
    guess = f"{' or '.join(hidden(guess) for guess in dotted)}? " if dotted else ""
    return RegraftError(hidden(override), f"{parent or 'the config'} has no setting {key}", f"{guess}{listed}")


def field_names(schema: type) -> list[str]:
    return [spec.name for spec in fields(schema)]


def stage_of(schema: type | None) -> str | None:
    """The stage whose config `schema` is (its `--cfg job --package`), if it is a stage's."""
    return next((stage for stage, known in SCHEMAS.items() if known is schema and (CONF_DIR / stage).is_dir()), None)


def mapping_takes(cause: OmegaConfBaseException) -> type | None:
    """The stage schema whose settings a plain mapping takes: its field's `settings_of` (source.build.finetune
    takes the finetune stage's); None when it says none."""
    mapping = getattr(cause, "parent_node", None)
    owner = mapping._get_parent() if mapping is not None else None
    schema = getattr(getattr(owner, "_metadata", None), "object_type", None)
    if not (isinstance(schema, type) and is_dataclass(schema)):
        return None
    spec = next((spec for spec in fields(schema) if spec.name == mapping._key()), None)
    return SCHEMAS.get(spec.metadata.get("settings_of", "")) if spec is not None else None


# a key given at the wrong depth is looked for elsewhere only while it names this few settings
ELSEWHERE_AT_MOST = 3


def placed_elsewhere(cause: OmegaConfBaseException, given: str) -> list[str]:
    """Every setting of the whole config whose dotted name ends with the one given (Hydra's own settings left out):
    where a key given at the wrong depth lives, when that is a few places."""
    root = getattr(cause, "parent_node", None)
    while root is not None and root._get_parent() is not None:
        root = root._get_parent()
    if not isinstance(root, DictConfig):
        return []
    found = [path for path in setting_paths(root) if path.endswith(f".{given}") and not path.startswith("hydra.")]
    return found if len(found) <= ELSEWHERE_AT_MOST else []


def setting_paths(node: DictConfig, prefix: str = "") -> Iterator[str]:
    """The dotted name of every key under `node`, read without resolving a value."""
    for key in node.keys():
        path, child = f"{prefix}{key}", node._get_node(key)
        yield path
        if isinstance(child, DictConfig) and not (child._is_missing() or child._is_none() or
                                                  child._is_interpolation()):
            yield from setting_paths(child, f"{path}.")


def given_override(exc: BaseException, cause: OmegaConfBaseException) -> str:
    """The override as given: Hydra's hint (`To append to your config use +finetune.lrr=1`) holds it."""
    found = re.search(r"use \+(\S+)", str(exc))
    return found.group(1) if found else cause.full_key


def setting_schema(cause: OmegaConfBaseException) -> type | None:
    """The schema (a dataclass) of the failing key's parent; None for a plain mapping."""
    schema = getattr(cause, "object_type", None)
    return schema if isinstance(schema, type) and is_dataclass(schema) else None


def setting_names(cause: OmegaConfBaseException) -> list[str]:
    """The keys the parent of the failing key has: its schema's fields, else the keys it holds."""
    schema = setting_schema(cause)
    if schema is not None:
        return field_names(schema)
    parent = getattr(cause, "parent_node", None)
    return [str(name) for name in parent.keys()] if parent is not None and hasattr(parent, "keys") else []


def wrong_value(cause: ValidationError) -> RegraftError:
    """A value the key's type refuses: the type (with its bounds, or its values for an enum), and an example."""
    override = hidden(f"{cause.full_key}={shown(cause.value)}")
    takes = field_type(cause)
    if takes is None:  # not a schema's field (a key inside a plain mapping): OmegaConf's own words
        return RegraftError(override, one_line(cause.msg), f"set {cause.full_key}= to a value of its type")
    example = example_value(getattr(cause, "child_node", None))
    fix = f"e.g. {cause.full_key}={example}" if example else f"set {cause.full_key}= to {takes}"
    return RegraftError(override, f"{cause.full_key} takes {takes}", fix)


def example_value(node: Any) -> str | None:
    """The key's value before the override, when it is a plain one worth showing (not null, missing, a mapping or
    an interpolation)."""
    value = shown(node)
    if value in ("null", "???", "") or "${" in value or value.startswith(("{", "[")):
        return None
    return value


def field_type(cause: ValidationError) -> str | None:
    """What the failing key's schema field takes, in words: `a float > 0`, `one of local, slurm, inline`."""
    schema, key = getattr(cause, "object_type", None), getattr(cause, "key", None)
    if not (isinstance(schema, type) and is_dataclass(schema)) or key is None:
        return None
    spec = next((spec for spec in fields(schema) if spec.name == key), None)
    if spec is None:
        return None
    annotation = typing.get_type_hints(schema)[key]
    inner = optional_of(annotation)
    words = type_words(inner or annotation)
    bounds = " and ".join(f"{BOUND_WORDS[bound][0]} {limit:g}" for bound, limit in
                          spec.metadata.get("bounds", {}).items())
    words = f"{words} {bounds}" if bounds else words
    return f"{words}, or null" if inner is not None else words


def optional_of(annotation: Any) -> Any:
    """X for Optional[X], else None."""
    arguments = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and type(None) in arguments:
        return next(argument for argument in arguments if argument is not type(None))
    return None


def type_words(annotation: Any) -> str:
    """A type as a user reads it."""
    origin = typing.get_origin(annotation) or annotation
    if isinstance(origin, type) and issubclass(origin, Enum):
        return f"one of {', '.join(member.name for member in origin)}"
    if isinstance(origin, type) and is_dataclass(origin):
        return f"a group of settings ({origin.__name__})"
    return {bool: "true or false", int: "an integer", float: "a float", str: "a string", dict: "a mapping {k: v}",
            list: "a list [a, b]", tuple: "a list [a, b]"}.get(origin, "a value of its type")


def shown(value: Any) -> str:
    """A value as an override writes it."""
    node_value = getattr(value, "_value", None)
    value = node_value() if callable(node_value) else value
    if value is None:
        return "null"
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def one_line(text: Any) -> str:
    """Hydra's or OmegaConf's message on one line, without the search path and the key's object types."""
    kept = []
    for line in (line.strip() for line in str(text).splitlines()):
        if line.startswith("Config search path"):
            break  # what follows is where Hydra looked, not what is wrong
        if line and not line.startswith(("full_key:", "reference_type=", "object_type=")):
            kept.append(line)
    return " ".join(kept)


def check_group_choices(choices: Mapping[str, str | None], loader: ConfigLoader) -> None:
    """Every config group's chosen option (`hydra.runtime.choices`) exists. Hydra skips an optional group's missing
    option without a word: `experiment=kimi_k2` would run the built-in example instead."""
    for group, option in choices.items():
        if option is None or group.startswith("hydra/"):
            continue  # a group left out, or one of Hydra's own (which Hydra checks)
        if (CONF_DIR / group / f"{option}.yaml").is_file():
            continue  # there as a file: asking Hydra, which searches every source, costs ~30 ms a group
        options = loader.get_group_options(group)
        if options and option not in options:
            raise missing_option(group, option, options)
