"""The engine surface (engine_surface.SURFACE) checked against an installed engine, by importing it.

Runs in the engine venv (`.venv-vllm`; regraft on PYTHONPATH, standard library only at module level), where the
engine imports: what regraft imports is imported, a keyword argument is a parameter of `inspect.signature` (or a
field of the class `**kwargs` feed), a member is on the class or assigned to `self` in its source (an instance
attribute set in `__init__`, such as the connector's `_block_size`), a field is a dataclass's, a msgspec Struct's, a
pydantic model's or an annotation, a positional call binds, and a server flag is an option of the parser vLLM's
own `make_arg_parser` builds. Strings (metric names, endpoints, values) are read from the installed package's
source as `engine_source_check` reads them. Prints one JSON object: the version and one result per `Reach`, each
with `how` (imported, or source).

    PYTHONPATH=. .venv-vllm/bin/python -m stages.common.engines.engine_api_check --engine vllm
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import sys
import textwrap
from pathlib import Path

from stages.common.engines.engine_source_check import Checker, Source, members
from stages.common.engines.engine_surface import STRINGS, Reach, surface
from stages.common.engines.vllm_worker import protocol_stream

PARSER_HOMES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                "vllm.entrypoints.openai.cli_args")


def resolve(dotted: str):
    """The object a dotted name names: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def field_names(cls) -> set[str]:
    names: set[str] = set(getattr(cls, "__struct_fields__", ()))  # msgspec
    names |= set(getattr(cls, "model_fields", {}) or {})  # pydantic
    if dataclasses.is_dataclass(cls):
        names |= {field.name for field in dataclasses.fields(cls)}
    for klass in getattr(cls, "__mro__", (cls,)):
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def self_assigned(cls) -> dict[str, str]:
    """Members assigned in the source of the class and its bases (`self.X = ...` in any method)."""
    found: dict[str, str] = {}
    for klass in getattr(cls, "__mro__", (cls,)):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                found = {**members(node), **found}
    return found


def placed(obj, home: str) -> tuple[str, str]:
    module = getattr(obj, "__module__", home)
    return ("ok", module) if module == home or not home else ("moved", f"defined in {module}, not {home}")


def parser_options() -> set[str] | None:
    """Every option string of vLLM's OpenAI server parser, as `vllm serve` builds it; None where it cannot be built."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for home in PARSER_HOMES:
        try:
            make = importlib.import_module(home).make_arg_parser
        except (ImportError, AttributeError):
            continue
        return set(make(FlexibleArgumentParser())._option_string_actions)
    return None


class Imported:
    def __init__(self, engine: str):
        self.engine = engine
        package = importlib.import_module(engine)
        self.source = Checker(Source(Path(package.__file__).parent.parent, engine))
        self._options: set[str] | None | bool = False

    def check(self, reach: Reach) -> dict:
        if reach.kind in STRINGS or (reach.kind == "cli-flag" and self.options is None):
            return {**self.source.check(reach), "how": "source"}
        try:
            status, detail = getattr(self, "check_" + reach.kind.replace("-", "_"))(reach)
        except Exception as exc:  # noqa: BLE001 (an import or attribute that fails is the finding)
            status, detail = "missing", f"{type(exc).__name__}: {exc}"
        return {"engine": reach.engine, "kind": reach.kind, "name": reach.name, "status": status, "detail": detail,
                "how": "imported"}

    @property
    def options(self) -> set[str] | None:
        if self._options is False:
            try:
                self._options = parser_options()
            except Exception:  # noqa: BLE001 (then the flags are read from the source)
                self._options = None
        return self._options

    def check_module(self, reach: Reach) -> tuple[str, str]:
        return "ok", importlib.import_module(reach.owner).__name__

    def check_class(self, reach: Reach) -> tuple[str, str]:
        return placed(resolve(reach.owner), reach.home)

    check_function = check_class

    def check_method(self, reach: Reach) -> tuple[str, str]:
        member = getattr(resolve(reach.owner), reach.member, None)
        return ("ok", "callable") if callable(member) else ("missing", f"no method {reach.member}")

    def check_attribute(self, reach: Reach) -> tuple[str, str]:
        cls = resolve(reach.owner)
        if hasattr(cls, reach.member):
            return "ok", "on the class"
        found = self_assigned(cls).get(reach.member)
        return ("ok", f"{found} in its source") if found else ("missing", f"{cls.__name__} has no {reach.member}")

    def check_field(self, reach: Reach) -> tuple[str, str]:
        cls = resolve(reach.owner)
        if reach.member in field_names(cls):
            return "ok", "a field"
        return self.check_attribute(reach)

    def check_name(self, reach: Reach) -> tuple[str, str]:
        return ("ok", type(getattr(resolve(reach.owner), reach.member)).__name__)

    def check_kwarg(self, reach: Reach) -> tuple[str, str]:
        target = resolve(reach.owner)
        parameters = inspect.signature(target).parameters
        if reach.member in parameters:
            return "ok", "a parameter"
        if any(p.kind is p.VAR_KEYWORD for p in parameters.values()) and reach.via:
            if reach.member in field_names(resolve(reach.via)):
                return "ok", f"through **kwargs: a field of {reach.via.rsplit('.', 1)[1]}"
        return "missing", f"not a parameter ({', '.join(parameters)})"

    def check_positional(self, reach: Reach) -> tuple[str, str]:
        signature = inspect.signature(resolve(reach.owner))
        try:
            signature.bind(*range(int(reach.member)))
        except TypeError as exc:
            return "missing", f"{signature}: {exc}"
        return "ok", str(signature)

    def check_cli_flag(self, reach: Reach) -> tuple[str, str]:
        found = reach.member in self.options
        return ("ok", "an option of make_arg_parser") if found else ("missing", "not an option of make_arg_parser")


def check_imported(engine: str) -> dict:
    checker = Imported(engine)
    return {"engine": engine, "version": checker.source.source.version, "python": sys.executable, "results": [checker.check(reach) for reach in surface(engine)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", default="vllm", choices=("vllm", "sglang"))
    engine = parser.parse_args(argv).engine
    out = protocol_stream()  # the JSON alone on stdout: what the engine logs as it imports goes to stderr
    out.write(json.dumps(check_imported(engine)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def run_in(python: str | Path, engine: str = "vllm", timeout_s: float = 900.0) -> dict:
    """This check run by another interpreter (the engine venv's), regraft on its path; its JSON report."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    done = subprocess.run([str(python), "-m", "stages.common.engines.engine_api_check", "--engine", engine], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"{python} could not check {engine} (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
