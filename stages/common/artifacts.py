"""Atomic stage outputs: work in a temp folder, write the manifest last, rename into place.

A stage output folder is complete only when its `manifest.json` says `"complete": true`; a crash leaves
at most a hidden `.NAME.tmp-*` folder beside it, never a half-written output.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "manifest.json"
# the packages whose version can change a stage's numbers; each manifest records the ones installed
NUMERIC_PACKAGES = ("torch", "transformers", "deepspeed", "tokenizers", "safetensors", "vllm")


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in NUMERIC_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def plain_config(config: Any) -> Any:
    """An OmegaConf config as plain resolved containers (enums as their names); other values unchanged."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(config, resolve=True, enum_to_str=True) if OmegaConf.is_config(config) else config


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    """The manifest of a complete stage output, or None when the folder is absent or incomplete."""
    path = Path(out_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return manifest if manifest.get("complete") is True else None


def _replace_dir(src: Path, dst: Path) -> None:
    """Move a finished temp folder onto dst; an older dst is moved aside first, then removed."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_output(out_dir: str | Path, stage: str, config: Any = None) -> Iterator["StagedOutput"]:
    """Yield a temp folder to write into; on success the manifest is written last and the folder renamed.

    `config` (the stage's resolved config) and the versions of the packages that change numbers are recorded in the
    manifest, so an output describes how it was made.
    """
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    staged = StagedOutput(stage=stage, tmp=tmp, final=out)
    if config is not None:
        staged.update(config=plain_config(config))
    try:
        yield staged
        staged.seal()
        _replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class StagedOutput:
    """A stage's output folder while it is being written. `path` is the temp folder."""

    def __init__(self, stage: str, tmp: Path, final: Path):
        self.stage = stage
        self.path = tmp
        self.final = final
        self.manifest: dict[str, Any] = {"stage": stage, "started_at": time.time(), "versions": package_versions()}

    def update(self, **fields: Any) -> None:
        self.manifest.update(fields)

    def seal(self) -> None:
        files = sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if p.is_file())
        self.manifest.update(files=files, finished_at=time.time(), complete=True)
        write_json_atomic(self.path / MANIFEST, self.manifest)
