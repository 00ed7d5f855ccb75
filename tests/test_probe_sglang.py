"""sglang backend of probe/evaluate: the launch command, the server lifecycle and the accept length, run against
tests/sglang_standin.py (a stand-in for SGLang: a real subprocess in its own process group, no model), and the
aux-layer convention check."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from stages.common.drafter.config import INPUT_OF_LAYER, OUTPUT_OF_LAYER, DrafterConfig, render_config
from stages.common.contract.errors import RegraftError
from stages.common.contract.runtime import free_port
from stages.common.drafter.acceptance import accept_length
from stages.common.engines.engine_process import LOAD_BYTES_PER_S, START_FLOOR_S, start_timeout
from stages.common.engines.sglang_backend import (SglangConfig, SglangServer, aux_convention_warning, drafter_convention,
                                                  engine_reading, generate, run_sglang, server_command)

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
CONVERSATIONS = [["one two three four five six seven", "eight nine"], ["hi"]]


def standin_cfg(**overrides) -> SglangConfig:
    values = dict(python=sys.executable, launch_module="tests.sglang_standin", startup_timeout_s=20.0,
                  request_timeout_s=10.0, stop_grace_s=5.0)
    return SglangConfig(**{**values, **overrides})


def render(messages: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def probe(cfg: SglangConfig, log_path: Path, conversations: list[list[str]] = CONVERSATIONS) -> list[dict]:
    return run_sglang(cfg, target="/models/target", drafter="/models/drafter", conversations=conversations,
                      render=render, max_new_tokens=6, num_steps=3, topk=1, num_draft_tokens=4, log_path=log_path)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan that init has not reaped yet has stopped running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


@pytest.fixture
def record(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "record.json"
    monkeypatch.setenv("REGRAFT_STANDIN_RECORD", str(path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return path


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory) -> dict:
    """One probe through a stand-in started by run_sglang (fixed port, a child process in the server's group)."""
    out = tmp_path_factory.mktemp("probe")
    cfg = standin_cfg(port=free_port(HOST), extra_args=["--standin-accept", "2", "--standin-spawn-child"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REGRAFT_STANDIN_RECORD", str(out / "record.json"))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        rows = probe(cfg, out / "server.log")
    return {"cfg": cfg, "rows": rows, "record": json.loads((out / "record.json").read_text()),
            "log": out / "server.log"}


# ----------------------------------------------------------------------------------------------- launch command

def test_server_command_is_sglangs_launch_line():
    cfg = SglangConfig(python="/envs/sgl/bin/python", tp=8, host="0.0.0.0")
    assert server_command(cfg, "/m/K2.5", "/d/eagle3", 3, 1, 4, 30000) == [
        "/envs/sgl/bin/python", "-m", "sglang.launch_server", "--model-path", "/m/K2.5",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d/eagle3",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--tp-size", "8", "--host", "0.0.0.0", "--port", "30000"]


def test_server_command_adds_mem_fraction_only_when_set_and_extras_last():
    cfg = SglangConfig(mem_fraction_static=0.8, extra_args=["--trust-remote-code", "--dtype", "bfloat16"])
    assert server_command(cfg, "t", "d", 5, 8, 32, 1234)[-7:] == [
        "--port", "1234", "--mem-fraction-static", "0.8", "--trust-remote-code", "--dtype", "bfloat16"]
    assert "--mem-fraction-static" not in server_command(SglangConfig(), "t", "d", 5, 8, 32, 1234)


def test_the_start_timeout_scales_with_the_checkpoints_a_server_loads_unless_it_is_given(tmp_path):
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    for folder, size in ((target, 3 * 10 ** 9), (drafter, 10 ** 9)):
        folder.mkdir()
        with (folder / "model-00001.safetensors").open("wb") as weights:
            weights.truncate(size)  # sparse: the size is what counts
    scaled = START_FLOOR_S + 4 * 10 ** 9 / LOAD_BYTES_PER_S
    assert start_timeout(None, target, drafter) == scaled
    assert start_timeout(None, tmp_path / "missing", None) == START_FLOOR_S  # nothing to read: the floor
    assert start_timeout(60.0, target, drafter) == 60.0
    command = server_command(SglangConfig(), str(target), str(drafter), 3, 1, 4, 1234)
    assert SglangServer(SglangConfig(), command, tmp_path / "log").startup_timeout_s == scaled
    assert SglangServer(SglangConfig(startup_timeout_s=60.0), command, tmp_path / "log").startup_timeout_s == 60.0


# ------------------------------------------------------------------------------------ a probe against the stand-in

def test_accept_length_is_completion_tokens_over_verify_steps(probe_run):
    rows = probe_run["rows"]
    # Stand-in rule: completion = min(6, words in the prompt), verify steps = ceil(completion / 2).
    # Prompts: 9 words -> 6 tokens, 3 steps; turn two, 19 words -> 6, 3; "user: hi\nassistant:" -> 3, 2.
    assert [(r["conversation"], r["turn"]) for r in rows] == [(0, 0), (0, 1), (1, 0)]
    assert [r["prompt_tokens"] for r in rows] == [9, 19, 3]
    assert [r["completion_tokens"] for r in rows] == [6, 6, 3]
    assert [r["verify_steps"] for r in rows] == [3, 3, 2]
    assert accept_length(rows) == pytest.approx(15 / 8)
    assert all(set(r) == {"conversation", "turn", "prompt_tokens", "completion_tokens", "verify_steps",
                          "seconds", "text"} for r in rows)
    assert all(isinstance(r["seconds"], float) and r["seconds"] > 0 for r in rows)


def test_cache_flushed_once_and_second_turn_carries_the_first_answer(probe_run):
    record, rows = probe_run["record"], probe_run["rows"]
    assert record["flush_cache"] == 1
    assert rows[0]["text"] == "five four three two one user:"
    assert record["generate"][1] == ("user: one two three four five six seven\n"
                                     "assistant: five four three two one user:\n"
                                     "user: eight nine\nassistant:")


def test_server_started_with_the_built_command(probe_run):
    cfg, record = probe_run["cfg"], probe_run["record"]
    command = server_command(cfg, "/models/target", "/models/drafter", 3, 1, 4, cfg.port)
    assert [record["executable"], "-m", "tests.sglang_standin"] == command[:3]
    assert record["module_file"] == str(REPO / "tests" / "sglang_standin.py")
    assert record["argv"] == command[3:]
    assert "standin: serving /models/target" in probe_run["log"].read_text()


def test_whole_process_group_is_gone_after_the_run(probe_run):
    record = probe_run["record"]
    assert record["child_pid"] is not None
    assert not running(record["pid"]) and not running(record["child_pid"])


def test_server_url_uses_the_running_server_and_starts_nothing(record, tmp_path):
    outer_cfg = standin_cfg()
    command = server_command(outer_cfg, "/models/target", "/models/drafter", 3, 1, 4, free_port(HOST))
    with SglangServer(outer_cfg, command, tmp_path / "outer.log") as outer:
        cfg = SglangConfig(python="/no/such/python", server_url=outer.url + "/", request_timeout_s=10.0)
        rows = probe(cfg, tmp_path / "inner.log", [["hi"]])
        assert outer.process.poll() is None
    assert not (tmp_path / "inner.log").exists()
    assert [(r["completion_tokens"], r["verify_steps"]) for r in rows] == [(3, 2)]
    assert json.loads(record.read_text())["flush_cache"] == 1


def test_server_url_without_a_server_is_one_clear_error(tmp_path):
    cfg = SglangConfig(server_url=f"http://{HOST}:{free_port(HOST)}", request_timeout_s=2.0)
    with pytest.raises(RegraftError, match="no healthy SGLang server answers GET /health"):
        probe(cfg, tmp_path / "server.log")


# ----------------------------------------------------------------------------------------------------- failures

def test_server_exiting_at_startup_names_its_log(record, tmp_path):
    log = tmp_path / "server.log"
    cfg = standin_cfg(extra_args=["--standin-fail", "CUDA error: no device"])
    with pytest.raises(RegraftError, match="exited with code 1 before it became healthy") as error:
        probe(cfg, log)
    assert str(error.value).startswith(f"{log}: ")
    assert "standin: CUDA error: no device" in str(error.value)
    assert "\n" not in str(error.value)


def test_server_never_healthy_times_out_and_is_killed(record, tmp_path):
    log = tmp_path / "server.log"
    cfg = standin_cfg(startup_timeout_s=1.5, stop_grace_s=0.5,
                      extra_args=["--standin-startup-delay", "600", "--standin-ignore-sigterm",
                                  "--standin-spawn-child"])
    with pytest.raises(RegraftError, match=r"not healthy after 1.5 s \(stopped it\)") as error:
        probe(cfg, log)
    assert str(log) in str(error.value) and "startup_timeout_s" in str(error.value)
    started = json.loads(record.read_text())
    # SIGTERM ignored: SIGKILL of the group did it; on a loaded machine the kernel may take a moment to deliver it
    assert gone(started["pid"]) and gone(started["child_pid"])


def test_server_crashing_mid_probe_names_its_log(record, tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(RegraftError, match="exited with code 3 during the probe") as error:
        probe(standin_cfg(extra_args=["--standin-crash-after", "1"]), log)
    assert str(error.value).startswith(f"{log}: ") and "CUDA out of memory" in str(error.value)
    assert len(json.loads(record.read_text())["generate"]) == 2


def test_missing_spec_verify_ct_is_one_clear_error(record, tmp_path):
    plain = [sys.executable, "-m", "tests.sglang_standin", "--model-path", "/models/target",
             "--host", HOST, "--port", str(free_port(HOST))]
    with SglangServer(standin_cfg(), plain, tmp_path / "server.log") as server:
        with pytest.raises(RegraftError, match="no spec_verify_ct: the server runs without speculative") as error:
            generate(server.url, "a b c", 4, 10.0)
    assert "--speculative-algorithm EAGLE3" in str(error.value) and "\n" not in str(error.value)


def test_unreachable_server_and_empty_rows_are_clear_errors():
    with pytest.raises(RegraftError, match="request failed"):
        generate(f"http://{HOST}:{free_port(HOST)}", "a b", 4, 2.0)
    with pytest.raises(RegraftError, match="no verify steps"):
        accept_length([])


# ------------------------------------------------------------------------------------------ aux-layer convention

def sglang_config(ids: list[int] | None, convention: str | None = None) -> dict:
    config: dict = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32}
    if ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    if convention:
        config["regraft"] = {"aux_convention": convention}
    return config


def speculators_config(ids: list[int], convention: str | None = None) -> dict:
    config: dict = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": ids}
    if convention:
        config["regraft"] = {"aux_convention": convention}
    return config


@pytest.mark.parametrize("config, engine", [
    (sglang_config([1, 15, 28], OUTPUT_OF_LAYER), "sglang"),
    (sglang_config([2, 16, 29], INPUT_OF_LAYER), "sglang"),  # kept as is since sglang PR #25454
    (sglang_config([1, 15, 28]), "sglang"),  # inferred: first id 1 -> output of layer
    (speculators_config([2, 16, 29]), "sglang"),
    (speculators_config([2, 16, 29]), "vllm"),
    (speculators_config([3, 16, 29]), "sglang"),  # inferred: the speculators layout's input of layer
    (sglang_config(None), "sglang"),  # no ids: the engine's defaults
])
def test_no_aux_warning_when_the_engine_reads_the_ids_as_trained(config, engine):
    assert aux_convention_warning(config, engine) is None


@pytest.mark.parametrize("config, engine, expected", [
    # input-of-layer ids starting at 1: SGLang adds one, and no id list can name these layers for it
    (sglang_config([1, 15, 28], INPUT_OF_LAYER), "sglang", ["as output_of_layer", "one layer deeper",
                                                           "no id list names these layers"]),
    # output-of-layer ids not starting at 1: SGLang passes them through; converting fixes it
    (sglang_config([2, 16, 29], OUTPUT_OF_LAYER), "sglang", ["as input_of_layer", "one layer shallower",
                                                            "--layout sglang --aux-convention input_of_layer"]),
    (sglang_config([3, 16, 29]), "sglang", ["output_of_layer (inferred)", "shallower"]),
    (sglang_config([1, 15, 28]), "vllm", ["vllm reads aux ids [1, 15, 28] as input_of_layer", "shallower",
                                          "--layout speculators --aux-convention input_of_layer"]),
])
def test_aux_warning_names_the_mismatch_and_the_fix(config, engine, expected):
    warning = aux_convention_warning(config, engine)
    assert warning is not None and "\n" not in warning
    assert all(part in warning for part in expected), warning


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
@pytest.mark.parametrize("convention, ids", [(OUTPUT_OF_LAYER, [1, 15, 28]), (OUTPUT_OF_LAYER, [2, 16, 29]),
                                             (INPUT_OF_LAYER, [2, 16, 29])])
def test_aux_warning_reads_what_regraft_writes(layout, convention, ids):
    layer = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}
    written = render_config(DrafterConfig(layer=layer, draft_vocab_size=32, aux_layer_ids=ids,
                                          aux_convention=convention), layout)
    warning = aux_convention_warning(written, "sglang")
    written_ids, written_convention, _ = drafter_convention(written)  # each layout in its engines' convention
    assert written_convention == {"sglang": OUTPUT_OF_LAYER, "speculators": INPUT_OF_LAYER}[layout]
    assert (warning is None) == (engine_reading(written_ids, "sglang") == written_convention)


def test_aux_warning_rejects_an_unknown_engine():
    with pytest.raises(RegraftError, match="unknown engine 'trtllm'"):
        aux_convention_warning(sglang_config([1, 15, 28]), "trtllm")
