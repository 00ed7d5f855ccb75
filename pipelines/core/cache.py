"""Content-addressed stage outputs: `<cache>/<stage>/<key>`, reused when their manifest says complete and every
file it lists is as it was written (CacheCheck: sizes always, sha256 by the `cache.verify` policy).

A key hashes the stage name, its own resolved config (the output path left out, @references replaced by the
upstream keys), a fingerprint of every outside path it reads, and the code version: every module of this project
the stage imports, directly or not (read from the sources with `ast`, lazy imports inside functions included), so
editing a module reruns exactly the stages that run it. Package versions (torch, transformers, ...) are not in the
key: each manifest records them, and a hit made under other versions is reported as such (docs/pipeline.md, the cache).
A file lock beside the output claims it, so two sweep members never run the same stage at once; the lock is an
flock, released by the kernel when its holder dies, so a killed run never blocks the next one.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock
from omegaconf import DictConfig, OmegaConf

from pipelines.core.dag import Node, substitute
from pipelines.core.registry import code_packages, entry
from stages.common.contract.artifacts import read_manifest, sha256_of
from stages.common.contract.errors import RegraftError

ROOT = Path(__file__).resolve().parents[2]
KEY_LENGTH = 16
# config fields naming places a stage writes, not reads: their names are in the key, never their contents (a race's
# shared checkpoint folder grows as later rungs train, and must not change the keys of the rungs before them)
WRITTEN_PATHS = ("out", "checkpoint_dir")


def module_file(name: str) -> Path | None:
    """The source file of a project module (a package's __init__.py), or None for anything else."""
    if name.split(".")[0] not in code_packages():
        return None
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def imported_names(path: Path, module: str) -> frozenset[str]:
    """Every module name an import statement of the file could load (a name after `from X import` may be one);
    each file parsed once per process (the stages share most of their modules)."""
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
    return frozenset(".".join(name.split(".")[:end]) for name in names for end in range(1, name.count(".") + 2))


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
    for name, path in sorted(project_modules(entry(stage).module).items()):
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
    """Fingerprints of the files a node reads from outside the cache: its top-level paths, and those in a list of
    entries (the probe's eval_sets)."""
    found = {}
    for key, value in OmegaConf.to_container(config, resolve=True).items():
        if key in WRITTEN_PATHS:
            continue
        items = [(key, value)]
        if isinstance(value, list):
            items = [(f"{key}.{index}.{field}", item) for index, entry in enumerate(value) if isinstance(entry, dict)
                     for field, item in entry.items()]
        for name, item in items:
            if isinstance(item, str) and not item.startswith("@") and "/" in item and (print_ := fingerprint(item)):
                found[name] = print_
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
    """A manifest that says complete, and every file it lists there at its recorded size (a stat per file)."""
    manifest = read_manifest(out)
    return bool(manifest) and not size_problem(out, manifest)


def size_problem(out: Path, manifest: dict) -> str | None:
    for name, recorded in manifest.get("checksums", {}).items():
        path = out / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != recorded["bytes"]:
            return f"{name} is {path.stat().st_size} bytes, its manifest says {recorded['bytes']}"
    return None


@dataclass(frozen=True)
class CacheCheck:
    """What a cache hit is checked for before it is reused (`cache.*` in the config, pipelines/schema.py)."""

    verify: str = "auto"  # size: presence and sizes; hash: also every file's sha256; auto: hash up to hash_limit_gb
    hash_limit_gb: float = 4.0  # auto, above this: only files whose mtime moved since the manifest are hashed
    on_mismatch: str = "recompute"  # or stop: end the run with one line naming the folder to delete

    @classmethod
    def of(cls, cfg: Any) -> "CacheCheck":
        """From the config's `cache` section (enum members or their names)."""
        name = lambda value: getattr(value, "name", str(value))  # noqa: E731
        return cls(name(cfg.verify), float(cfg.hash_limit_gb), name(cfg.on_mismatch))

    def files_to_hash(self, out: Path, checksums: dict[str, dict]) -> list[str]:
        if self.verify == "size":
            return []
        total = sum(recorded["bytes"] for recorded in checksums.values())
        if self.verify == "hash" or total <= self.hash_limit_gb * 2**30:
            return list(checksums)
        return [name for name, recorded in checksums.items() if (out / name).stat().st_mtime_ns != recorded["mtime_ns"]]

    def problem(self, out: Path) -> str | None:
        """Why a complete output must not be reused (a file missing, resized or changed), or None."""
        manifest = read_manifest(out) or {}
        checksums = manifest.get("checksums", {})
        found = size_problem(out, manifest)
        if found:
            return found
        for name in self.files_to_hash(out, checksums):
            if sha256_of(out / name) != checksums[name]["sha256"]:
                return f"{name} no longer has the sha256 its manifest recorded"
        return None


def verified_hit(out: Path, check: CacheCheck, say: Callable[[str], None]) -> bool:
    """Whether a stage's output can be reused: complete and as its manifest recorded it. An output that is not is
    moved aside and removed (under its lock), so the stage runs again, or ends the run under on_mismatch=stop."""
    if read_manifest(out) is None:
        return False
    problem = check.problem(out)
    if problem is None:
        return True
    if check.on_mismatch == "stop":
        raise RegraftError(out, f"cached output changed since it was written: {problem}",
                           f"delete the folder (rm -r {out}) and rerun, or set cache.on_mismatch=recompute")
    with stage_lock(out):
        if read_manifest(out) is not None and check.problem(out) is not None:
            discard(out)
    say(f"{out}: {problem}; not reused, computing it again")
    return False


def discard(out: Path) -> None:
    aside = out.with_name(f".{out.name}.bad-{uuid.uuid4().hex[:8]}")
    os.replace(out, aside)
    shutil.rmtree(aside, ignore_errors=True)


def stage_lock(out: Path) -> FileLock:
    out.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(out.with_name(out.name + ".lock")))


def sweep_leftovers(out: Path) -> None:
    """Temp folders of runs that died before their rename (only called while holding the stage's lock)."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
