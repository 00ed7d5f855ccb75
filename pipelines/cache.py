"""Content-addressed stage outputs: `<cache>/<stage>/<key>`, reused whenever their manifest says complete.

A key hashes the stage name, its own resolved config (the output path left out, @references replaced by the
upstream keys), a fingerprint of every outside path it reads, and the code version (the stage's module and
stages/common). A file lock beside the output claims it, so two sweep members never run the same stage at once;
the lock is an flock, released by the kernel when its holder dies, so a killed run never blocks the next one.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from functools import lru_cache
from pathlib import Path

from filelock import FileLock
from omegaconf import DictConfig, OmegaConf

from pipelines.dag import Node, substitute
from stages.common.artifacts import read_manifest

STAGES_DIR = Path(__file__).resolve().parents[1] / "stages"
KEY_LENGTH = 16


@lru_cache(maxsize=None)
def code_version(stage: str) -> str:
    """A hash of the code a stage runs: its module and the shared library under stages/common."""
    digest = hashlib.sha256()
    for path in [STAGES_DIR / f"{stage}.py", *sorted((STAGES_DIR / "common").glob("*.py"))]:
        digest.update(path.name.encode())
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
