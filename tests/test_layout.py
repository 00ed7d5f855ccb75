"""pipelines/ in packages, and the rules each package's `__init__` docstring declares (`May import: ...`): every
import a module makes (read with `ast`, imports inside functions included; pipelines/core/cache.py reads them the same
way for the cache keys) goes within its own package or to one the package may import, and no imports form a circle."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pipelines.core import cache

RULE = re.compile(r"^May import: (.+?)\.?$", re.M)
NOTHING = "nothing else of pipelines"


def modules(root: Path) -> dict[str, Path]:
    """Every module of pipelines/ under `root` by its dotted name (a package by its `__init__.py`)."""
    found = {}
    for path in sorted((root / "pipelines").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def group(name: str, found: dict[str, Path]) -> str:
    """The package whose rules a module follows: `pipelines.X` for a module of package X (its subpackages too),
    `pipelines` for a top-level module."""
    top = ".".join(name.split(".")[:2])
    return top if found.get(top, Path()).name == "__init__.py" else "pipelines"


def rules(found: dict[str, Path]) -> dict[str, tuple[str, ...]]:
    """Each package's `May import:` line: the packages and modules its modules may import besides their own."""
    declared = {}
    for name, path in found.items():
        if path.name == "__init__.py" and group(name, found) == name:
            match = RULE.search(ast.get_docstring(ast.parse(path.read_text())) or "")
            assert match, f"{path}: its docstring says what the package holds and ends `May import: ...`"
            allowed = match.group(1)
            declared[name] = () if allowed == NOTHING else tuple(part.strip() for part in allowed.split(","))
    return declared


def imports(found: dict[str, Path]) -> dict[str, set[str]]:
    """The pipelines modules each module imports (not the packages above the one it names: their `__init__` runs
    no code, which test_a_package_init_imports_nothing holds)."""
    return {name: {target for target in cache.imported_names(path, name)
                   if target in found and target != name and found[target].name != "__init__.py"}
            for name, path in found.items()}


def broken_rules(root: Path) -> list[str]:
    found = modules(root)
    declared = rules(found)
    broken = []
    for name, targets in imports(found).items():
        own = group(name, found)
        for target in sorted(targets):
            if group(target, found) == own or any(target == allowed or target.startswith(allowed + ".")
                                                  for allowed in declared[own]):
                continue
            broken.append(f"{name} imports {target}: {own} may import {', '.join(declared[own]) or NOTHING}")
    return broken


def circles(root: Path) -> list[list[str]]:
    """Every set of modules that import one another, directly or not (Tarjan's strongly connected components)."""
    graph = imports(modules(root))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in graph[name]:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            members = []
            while not members or members[-1] != name:
                members.append(stack.pop())
            if len(members) > 1:
                found.append(sorted(members))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_every_import_follows_its_packages_rules():
    assert not broken_rules(cache.ROOT)


def test_no_imports_form_a_circle():
    assert not circles(cache.ROOT)


@pytest.mark.parametrize("path", sorted((cache.ROOT / "pipelines").rglob("__init__.py")),
                         ids=lambda path: str(path.parent.relative_to(cache.ROOT)))
def test_a_package_init_imports_nothing(path):
    """A package's `__init__` is its docstring: importing one module of it runs no other."""
    body = ast.parse(path.read_text()).body
    assert all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body), path


def test_the_rules_catch_an_import_up_a_sideways_one_and_a_circle(tmp_path):
    files = {
        "pipelines/__init__.py": '"""Top.\n\nMay import: pipelines.core, pipelines.tracking."""\n',
        "pipelines/command.py": "from pipelines.core import runner\n",
        "pipelines/core/__init__.py": '"""Core.\n\nMay import: nothing else of pipelines."""\n',
        "pipelines/core/runner.py": "def run():\n    from pipelines import command\n",  # up, inside a function
        "pipelines/core/dag.py": "from .cache import key\n",
        "pipelines/core/cache.py": "from pipelines.core.dag import Node\n",  # a circle within the package
        "pipelines/tracking/__init__.py": '"""Tracking.\n\nMay import: pipelines.core."""\n',
        "pipelines/tracking/outbox.py": "from pipelines.launch import local\n",  # sideways: not declared
        "pipelines/launch/__init__.py": '"""Launch.\n\nMay import: pipelines.core."""\n',
        "pipelines/launch/local.py": "import pipelines.core.dag\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert broken_rules(tmp_path) == [
        "pipelines.core.runner imports pipelines.command: pipelines.core may import nothing else of pipelines",
        "pipelines.tracking.outbox imports pipelines.launch.local: pipelines.tracking may import pipelines.core"]
    assert circles(tmp_path) == [["pipelines.command", "pipelines.core.runner"],  # the import up closes one too
                                 ["pipelines.core.cache", "pipelines.core.dag"]]
