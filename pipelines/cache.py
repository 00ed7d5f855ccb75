"""Content-addressed stage outputs: `<cache>/<stage>/<key>`, reused whenever their manifest says complete.

A key hashes the stage name, its own resolved config (the output path left out, @references replaced by the
upstream keys), a fingerprint of every outside path it reads, and the code version: every module of this project
the stage imports, directly or not (read from the sources with `ast`, lazy imports inside functions included), so
editing a module reruns exactly the stages that run it. Package versions (torch, transformers, ...) are not in the
key: each manifest records them, and a hit made under other versions is reported as such (README: the cache).
A file lock beside the output claims it, so two sweep members never run the same stage at once; the lock is an
flock, released by the kernel when its holder dies, so a killed run never blocks the next one.
"""
from __future__ import annotations

import ast
import hashlib
import json
import shutil
from functools import lru_cache
from pathlib import Path

from filelock import FileLock
from omegaconf import DictConfig, OmegaConf

from pipelines.dag import Node, substitute
from stages.common.artifacts import read_manifest

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("stages", "pipelines")
KEY_LENGTH = 16
# config fields naming places a stage writes, not reads: their names are in the key, never their contents (a race's
# shared checkpoint folder grows as later rungs train, and must not change the keys of the rungs before them)
WRITTEN_PATHS = ("out", "checkpoint_dir")


def module_file(name: str) -> Path | None:
    """The source file of a project module (a package's __init__.py), or None for anything else."""
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name an import statement of the file could load (a name after `from X import` may be one)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = node.module if not node.level else ".".join(filter(None, (anchor, node.module)))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    # importing a.b.c runs a/__init__.py and a/b/__init__.py first
    return {".".join(name.split(".")[:end]) for name in names for end in range(1, name.count(".") + 2)}


@lru_cache(maxsize=None)
def project_modules(module: str) -> dict[str, Path]:
    """The project modules `module` runs: itself and everything it imports, transitively."""
    found: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        path = module_file(name)
        if name in found or path is None:
            continue
        found[name] = path
        pending.extend(imported_names(path, name))
    return found


@lru_cache(maxsize=None)
def code_version(stage: str) -> str:
    """A hash of the code a stage runs: its module and every project module it imports, transitively."""
    digest = hashlib.sha256()
    for name, path in sorted(project_modules(f"stages.{stage}").items()):
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:KEY_LENGTH]


def fingerprint(value: str) -> str | None:
    """Size and mtime of an outside file or folder (its top-level entries): cheap, and enough to see a change."""
    path = Path(value)
    if not value or not path.exists():
        return None
    entries = [path] if path.is_file() else sorted(path.iterdir())
    return hashlib.sha256(repr([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in entries]).encode()
                          ).hexdigest()[:KEY_LENGTH]


def outside_paths(config: DictConfig) -> dict[str, str]:
    found = {}
    for key, value in OmegaConf.to_container(config, resolve=True).items():
        if key in WRITTEN_PATHS:
            continue
        if isinstance(value, str) and not value.startswith("@") and "/" in value and (print_ := fingerprint(value)):
            found[key] = print_
    return found


def node_key(node: Node, upstream_keys: dict[str, str]) -> str:
    config = substitute(node.config, lambda name, sub: f"@{upstream_keys[name]}/{sub or ''}")
    config.pop("out", None)
    payload = {"stage": node.stage, "config": OmegaConf.to_container(config), "code": code_version(node.stage),
               "outside": outside_paths(config)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:KEY_LENGTH]


def keys_for(nodes: list[Node]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for node in nodes:
        keys[node.name] = node_key(node, keys)
    return keys


def output_dir(cache_root: Path, stage: str, key: str) -> Path:
    return cache_root / stage / key


def is_complete(out: Path) -> bool:
    manifest = read_manifest(out)
    return bool(manifest and manifest.get("complete"))


def stage_lock(out: Path) -> FileLock:
    out.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(out.with_name(out.name + ".lock")))


def sweep_leftovers(out: Path) -> None:
    """Temp folders of runs that died before their rename (only called while holding the stage's lock)."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
