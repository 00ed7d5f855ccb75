"""A drafter is decoded the way its engines decode it, or refused: every stage that reads a drafter refuses a config
key that changes the drafter's function and that regraft does not implement (a GELU MLP, a key no one listed), with
one line naming the file and the key; the same key at its plain value, and real plain EAGLE-3 configs, are read as
before. The EAGLE-3.1 toggles are implemented (tests/test_families.py): a config that sets one needs its tensors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

from stages import diagnose, features, finetune, probe, remap
from stages.common.drafter.checkpoint import DrafterCheckpoint, convert_checkpoint
from stages.common.drafter.checkpoint import main as convert_main
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import compose_stage
from stages.common.engines.vllm_engine import engine_available
from tests.conftest import finetune_cfg, random_map

# (what is changed, where in config.json, the key the refusal names)
BAD = {
    "function": ((), "hidden_act", "gelu"),  # vLLM builds the MLP it names; regraft's is SiLU
    "unknown": ((), "attn_temperature", 0.7),  # a key no one listed: it may change the function
    "nested": (("eagle_config",), "use_aux_hidden_state", False),  # vLLM drops fc then; regraft always has it
}


def edited(source: Path, dest: Path, path: tuple[str, ...], key: str, value) -> Path:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    block = config
    for name in path:
        block = block.setdefault(name, {})
    block[key] = value
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.fixture(scope="module")
def drafters(target_dir, vocab_size, tmp_path_factory) -> dict[str, Path]:
    from stages.common.drafter.config import drafter_config_for
    from stages.common.drafter.eagle3 import Eagle3Drafter

    root = tmp_path_factory.mktemp("drafter_keys")
    good = Eagle3Drafter.initialised(drafter_config_for(target_dir, 64), random_map(vocab_size, 64, 0)).save(
        root / "good")
    made = {name: edited(good, root / name, *change) for name, change in BAD.items()}
    made["plain_flag"] = edited(good, root / "plain_flag", (), "mlp_bias", False)
    return {"good": good, **made}


def one_line(message: str, drafter: Path, key: str) -> None:
    assert "\n" not in message and str(drafter / "config.json") in message and key in message, message


def test_each_kind_of_key_is_refused_on_open_and_named(drafters):
    for name, (path, key, _) in BAD.items():
        with pytest.raises(RegraftError) as refused:
            DrafterCheckpoint.open(drafters[name])
        one_line(str(refused.value), drafters[name], ".".join((*path, key)))
    assert "changes how the drafter decodes" in str(pytest.raises(
        RegraftError, DrafterCheckpoint.open, drafters["function"]).value)
    assert "unknown drafter config key attn_temperature" in str(pytest.raises(
        RegraftError, DrafterCheckpoint.open, drafters["unknown"]).value)


def test_a_flag_at_its_plain_value_is_read_and_kept(drafters, tmp_path):
    assert DrafterCheckpoint.open(drafters["plain_flag"]).config.layer["mlp_bias"] is False
    spec = convert_checkpoint(drafters["plain_flag"], tmp_path / "spec", "speculators")
    back = convert_checkpoint(spec, tmp_path / "back", "sglang")
    assert json.loads((back / "config.json").read_text())["mlp_bias"] is False


def test_speculators_layer_config_keys_are_checked_too(drafters, tmp_path):
    spec = convert_checkpoint(drafters["good"], tmp_path / "spec", "speculators")
    bad = edited(spec, tmp_path / "bad", ("transformer_layer_config",), "kv_lora_rank", 512)  # an MLA layer
    with pytest.raises(RegraftError, match=r"transformer_layer_config\.kv_lora_rank=512: an MLA layer"):
        DrafterCheckpoint.open(bad)
    wrong = edited(spec, tmp_path / "wrong", ("transformer_layer_config",), "hidden_act", "gelu")
    with pytest.raises(RegraftError, match=r"transformer_layer_config\.hidden_act=\"gelu\" changes how"):
        DrafterCheckpoint.open(wrong)
    top = edited(spec, tmp_path / "top", (), "fc_norm", True)  # speculators puts the EAGLE-3.1 toggles at the top
    with pytest.raises(RegraftError, match=r"missing tensors \['fc_norm\.0\.weight', 'fc_norm\.1\.weight'"):
        DrafterCheckpoint.open(top)  # read as EAGLE-3.1, whose per-aux norms these weights lack


# The configs real plain EAGLE-3 drafters ship (SpecForge configs/kimi-k2-eagle3.json, llama3-8B-eagle3.json), at a
# tiny width: every key they carry is known. Llama-3.1's scaled RoPE is not implemented, so it is refused.
KIMI_K2 = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {
    "eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True}, "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 163584, "eos_token_id": 163585, "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 131072,
    "max_window_layers": 48, "model_type": "kimi_k2", "num_attention_heads": 4, "num_hidden_layers": 1,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.53.2",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 512, "draft_vocab_size": 64}
LLAMA3_8B = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
             "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
             "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
             "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
             "use_cache": True, "vocab_size": 512, "draft_vocab_size": 64}


def test_real_plain_eagle3_configs_are_accepted():
    from stages.common.drafter.config import parse_config

    for raw in (KIMI_K2, LLAMA3_8B, {**KIMI_K2, "dtype": "bfloat16", "mlp_bias": False, "pretraining_tp": 1}):
        parse_config(json.loads(json.dumps(raw)), Path("config.json"))
    llama3_rope = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    with pytest.raises(RegraftError, match=r"rope_scaling=.*llama3.* changes how"):
        parse_config({**LLAMA3_8B, "rope_scaling": llama3_rope}, Path("config.json"))
    parse_config({**LLAMA3_8B, "rope_scaling": {"rope_type": "default"}}, Path("config.json"))


# ---------------------------------------------------------------- every stage that reads a drafter

Stage = Callable[[Path, dict, Path], None]


def run_remap(drafter, fx, out):
    remap.run(compose_stage("remap", [f"drafter={drafter}", f"vocab_map={fx['map']}", f"verifier={fx['target']}",
                                      f"out={out}"]))


def run_finetune(init: str) -> Stage:
    def run(drafter, fx, out):
        finetune.run(finetune_cfg(fx["target"], fx["chats"], fx["map"], out, f"init={init}", f"drafter={drafter}",
                                  "max_steps=1"))
    return run


def run_probe(backend: str) -> Stage:
    def run(drafter, fx, out):
        probe.run(compose_stage("probe", [f"target={fx['target']}", f"drafter={drafter}", f"out={out}",
                                          "num_prompts=1", "max_new_tokens=4", f"backend={backend}"]))
    return run


def run_diagnose(drafter, fx, out):
    diagnose.run(compose_stage("diagnose", [f"drafter={drafter}", f"target={fx['target']}", f"data={fx['chats']}",
                                            f"vocab_map={fx['map']}", f"out={out}"]))


def run_features(drafter, fx, out):
    features.run(compose_stage("features", [f"target={fx['target']}", f"data={fx['chats']}", f"out={out}",
                                            f"drafter={drafter}", "max_length=32"]))


def run_preflight(drafter, fx, out):
    """The `regraft` command's preflight, which reads the source drafter before any stage runs."""
    from hydra import compose, initialize_config_dir

    from pipelines.modes.preflight import check_models
    from stages.common.contract.stage import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.outputs={out}", "source.build=null", f"source.path={drafter}",
                                           f"target.path={fx['target']}", f"data.train={fx['chats']}",
                                           "vocab_map.draft_vocab_size=64"])
    check_models(cfg)


STAGES: dict[str, Stage] = {
    "remap": run_remap, "finetune_as_is": run_finetune("as_is"), "finetune_remap": run_finetune("remap"),
    "finetune_scratch": run_finetune("scratch"), "probe_hf": run_probe("hf"), "probe_sglang": run_probe("sglang"),
    "probe_vllm": run_probe("vllm"), "diagnose": run_diagnose, "features": run_features, "preflight": run_preflight}


@pytest.fixture(scope="module")
def inputs(target_dir, chats, training_map) -> dict:
    return {"target": target_dir, "chats": chats, "map": training_map}


@pytest.mark.parametrize("bad", ["function", "unknown"])
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_that_reads_a_drafter_refuses_it(stage, bad, drafters, inputs, tmp_path):
    if stage == "probe_vllm" and not engine_available():
        pytest.skip("no vLLM engine venv: run `make venv-vllm`")
    with pytest.raises(RegraftError) as refused:
        STAGES[stage](drafters[bad], inputs, tmp_path / "out")
    one_line(str(refused.value), drafters[bad], BAD[bad][1])
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("bad", ["function", "unknown"])
def test_the_convert_command_refuses_it_in_one_line(bad, drafters, tmp_path, capsys):
    assert convert_main([str(drafters[bad]), str(tmp_path / "out"), "--layout", "speculators"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    one_line(lines[0], drafters[bad], BAD[bad][1])
    assert not (tmp_path / "out").exists()
