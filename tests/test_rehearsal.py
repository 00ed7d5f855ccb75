"""The dress rehearsal of `experiment=kimi_k25` (bench/rehearsal.py): the real experiment file on a miniature of
Kimi-K2.5 in its released layout, a real `vllm serve` for regenerate, the features and probes on the hf path
(bench/rehearsal.py MACHINE says why), DeepSpeed bf16 ZeRO-2 over two ranks. About five minutes:
marked long (`make test PYTEST_ARGS="-m long"`)."""
from __future__ import annotations

import math

import pytest

from bench.rehearsal import MACHINE, SERVER_TOKENS, SIZES, run_rehearsal
from tests.servers import needs_engine

STAGES = ("regenerate", "vocab_map", "compare", "remap", "diagnose", "features", "probe", "finetune", "evaluate")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> dict:
    return run_rehearsal(tmp_path_factory.mktemp("rehearsal"))


@pytest.mark.long
@needs_engine
def test_the_experiment_runs_end_to_end_as_written(rehearsal):
    assert rehearsal["returncode"] == 0, rehearsal["stdout"][-3000:] + rehearsal["stderr"][-3000:]
    summary = rehearsal["summary"]
    assert set(STAGES) <= set(summary["stages"])
    assert not any(stage["hit"] for stage in summary["stages"].values())  # a fresh folder: everything computed
    # only paths, sizes and the three machine settings were overridden
    overridden = {item.split("=", 1)[0] for item in rehearsal["overrides"]}
    assert overridden - {"experiment", "target.path", "source.path", "data.train", "data.eval_sets",
                         "regenerate.server_url", "paths.outputs", "features.vllm.python"} \
        == {item.split("=", 1)[0] for item in (*SIZES, *MACHINE)}
    config = summary["config"]
    assert config["features"]["backend"] == "hf" and config["probe"]["backend"] == "hf"
    assert config["finetune"]["deepspeed"] == {**config["finetune"]["deepspeed"], "zero_stage": 2, "bf16": True}


@pytest.mark.long
@needs_engine
def test_the_stages_read_the_kimi_layout(rehearsal):
    summary = rehearsal["summary"]
    stages = summary["stages"]
    regenerated = stages["regenerate"]["metrics"]
    assert regenerated["answered"] > 0 and regenerated["tokens"] > 0  # through the real `vllm serve`
    features = stages["features"]["metrics"]
    assert features["rows"] == regenerated["answered"]
    # bf16 states of the language model (hidden 64): 3 aux per token, 2 bytes each, plus the loss-masked last ones
    assert features["bytes_per_token"] >= 3 * 64 * 2
    remap = stages["remap"]["metrics"]
    assert remap["rows_remapped"] + remap["rows_from_fallback"] == 256 and remap["rows_remapped"] > 0
    # the same MLA format from source to export: the baseline is the source's family
    for name in ("finetune", "baseline_finetune"):
        assert stages[name]["headline"].startswith("mla, ")
        assert math.isfinite(stages[name]["metrics"]["val_loss"])
    numbers = summary["numbers"]
    for phase in ("phase0", "phase1", "scratch"):  # measured, each set on its own; how well is no rehearsal's to say
        assert numbers[f"{phase}/accept_len"] >= 1.0
        assert {f"{phase}/accept_len/prose", f"{phase}/accept_len/code"} <= set(numbers)


@pytest.mark.long
@needs_engine
def test_the_server_check_compares_every_token(rehearsal):
    agreement = rehearsal["agreement"]
    assert agreement["prompts"] == 4 and agreement["tokens"] == 4 * SERVER_TOKENS


@pytest.mark.long
@needs_engine
@pytest.mark.xfail(strict=True, reason="found by the rehearsal: vLLM 0.32's CPU build computes DeepSeek-V3 (MLA) "
                   "unlike transformers in float32 past the first position; a bare DeepseekV3ForCausalLM with sharp "
                   "attention shows it too, whatever the rope layout or softmax scale: vLLM's CPU MLA path, not the "
                   "Kimi layout")
def test_the_server_computes_what_transformers_computes(rehearsal):
    agreement = rehearsal["agreement"]
    assert agreement["equal_tokens"] == agreement["tokens"] and agreement["max_logprob_diff"] < 1e-3
