"""The built-in world is the same on every x86 CPU (stages.common.contract.runtime.SAME_ON_EVERY_CPU): built in fresh
interpreters that would each compute another way on their own (another ATen kernel build, another MKL setting,
another thread count), world=tiny comes out with one digest, the one tests/test_world.py pins."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stages.common.contract.runtime import SAME_ON_EVERY_CPU
from tests.test_world import tiny_world_digest

ROOT = Path(__file__).resolve().parents[1]
# what a process does with no help: the machine's own choices, written as the settings that would make them
ANOTHER_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
               "OMP_NUM_THREADS": "2"}
PROBE = """
import hashlib, json, sys, torch
from stages.common.contract.runtime import same_on_every_cpu
cpu = same_on_every_cpu() if sys.argv[1] == "settings" else {}
g = torch.Generator().manual_seed(0)
x, w = torch.randn(64, 96, generator=g), torch.randn(128, 96, generator=g)
y = torch.nn.functional.linear(x, w).softmax(-1)
print(json.dumps({"cpu": cpu, "sha": hashlib.sha256(y.numpy().tobytes()).hexdigest()}))
"""
TINY_WORLD = """
import sys
from stages import world
from stages.common.contract.stage import compose_stage
world.run(compose_stage("world", [f"out={sys.argv[1]}"], option="tiny"))
"""


def fresh(argv: list[str], env: dict[str, str], timeout: float) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ANOTHER_CPU and k != "REGRAFT_WORLD_FRESH"}
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def probe(settings: bool, env: dict[str, str]) -> dict:
    return json.loads(fresh(["-c", PROBE, "settings" if settings else "none"], env, 120).splitlines()[-1])


def test_the_machine_picks_the_numbers_unless_the_settings_do():
    """Without them, two kernel builds give two answers to one computation; with them, one answer: the one a
    process started with them in its environment gives."""
    assert probe(False, {}) != probe(False, ANOTHER_CPU)
    here, there = probe(True, {}), probe(True, ANOTHER_CPU)
    assert here == there and here["cpu"]["in_effect"], (here, there)
    # and it is what the settings give when the environment holds them from the start
    assert here["sha"] == probe(False, SAME_ON_EVERY_CPU)["sha"]
    assert here["cpu"]["cpu_capability"] == "AVX2" and here["cpu"]["mkl_cbwr"] == "COMPATIBLE"


def test_world_tiny_has_one_digest_on_two_emulated_cpus(tmp_path):
    digests = {}
    for name, env in (("this CPU", {}), ("another CPU", ANOTHER_CPU)):
        out = tmp_path / name.replace(" ", "_")
        fresh(["-c", TINY_WORLD, str(out)], env, 300)
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["cpu"]["in_effect"], manifest["cpu"]
        digests[name] = manifest["digest"]
    assert set(digests.values()) == {tiny_world_digest()}, digests
