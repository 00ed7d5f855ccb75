"""Which torch `make venv` installs (tools/torch_wheel.py): the CPU build here, a CUDA build that runs Blackwell
where nvidia-smi lists a GPU, the build a user names, and one that cannot run Blackwell refused in one line.
Nothing is installed: the command lines are read from `make -n`."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import torch_wheel  # noqa: E402


def fake_nvidia_smi(folder: Path, listing: str, code: int = 0) -> Path:
    """An `nvidia-smi` that prints `listing` for -L and exits `code` (a node whose driver answers, or not)."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '%s\\n' '{listing}'\nexit {code}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return folder


def make_venv_lines(env: dict[str, str]) -> str:
    """What `make venv` would run on a fresh checkout (-W: as if pyproject.toml had changed), without running it."""
    done = subprocess.run(["make", "-n", "-W", "pyproject.toml", "venv"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)
    return done.stdout + done.stderr


def test_each_choice_gives_its_wheel():
    assert torch_wheel.choose("2.13.0", "auto", gpu=False) == ["torch==2.13.0"]
    assert torch_wheel.choose("2.13.0", "cpu", gpu=True) == ["torch==2.13.0"]
    assert torch_wheel.choose("2.13.0", "auto", gpu=True) == [
        "torch==2.13.0+cu130", "--extra-index-url", "https://download.pytorch.org/whl/cu130"]
    assert torch_wheel.choose("2.13.0", "cu128", gpu=False)[0] == "torch==2.13.0+cu128"


@pytest.mark.parametrize("build", ["cu126", "cu118"])
def test_a_build_without_blackwell_kernels_is_refused(build):
    with pytest.raises(ValueError, match="no Blackwell"):
        torch_wheel.choose("2.13.0", build, gpu=True)


def test_a_name_that_is_no_build_is_refused():
    with pytest.raises(ValueError, match="is not a build"):
        torch_wheel.choose("2.13.0", "cuda", gpu=True)


def test_make_venv_takes_the_cpu_build_here_and_a_cuda_build_on_a_gpu_node(tmp_path):
    path = os.environ["PATH"]
    here = make_venv_lines({"PATH": path})
    assert "pip install --quiet torch==2.13.0 uv" in here
    node = fake_nvidia_smi(tmp_path / "gpu", "GPU 0: NVIDIA B200 (UUID: GPU-0)")
    on_node = make_venv_lines({"PATH": f"{node}:{path}"})
    assert "pip install --quiet torch==2.13.0+cu130 --extra-index-url https://download.pytorch.org/whl/cu130 uv" \
        in on_node
    # the same versions beside it: uv keeps the installed build, which meets ==2.13.0
    assert "-e '.[dev]' torch==2.13.0" in on_node
    no_driver = fake_nvidia_smi(tmp_path / "nodriver", "NVIDIA-SMI has failed", code=9)
    assert "pip install --quiet torch==2.13.0 uv" in make_venv_lines({"PATH": f"{no_driver}:{path}"})
    named = make_venv_lines({"PATH": path, "REGRAFT_TORCH": "cu128"})
    assert "torch==2.13.0+cu128 --extra-index-url https://download.pytorch.org/whl/cu128" in named


def test_make_venv_refuses_an_old_cuda_build_in_one_line_and_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "venv", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "REGRAFT_TORCH": "cu126"})
    said = [line for line in done.stderr.splitlines() if line.startswith("make venv:")]
    assert done.returncode != 0 and len(said) == 1
    assert "cu126" in said[0] and "use cu130 or cu128" in said[0]
    assert "pip install" not in done.stdout  # stopped before torch
    assert not list(venv.glob("lib/python*/site-packages/torch"))
