"""Online features (`finetune.engine`, the pipeline's features.mode=online): a fine-tune whose target states come
from a real `vllm serve` (the engine venv, regraft's CPU hidden-states connector), a batch at a time, read ahead.

Tolerance: the server runs the target in fp32 with vLLM's CPU kernels, the offline features with transformers'
(tests/test_features_vllm.py measures the states ~1e-6 relative apart); so the step-0 loss agrees to 1e-5 and the
weights after a few steps to what a few AdamW steps make of such differences (1e-4 relative, 1e-6 absolute).
"""
from __future__ import annotations

import pytest
import torch

from stages import features, finetune
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import compose_stage
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.engines.vllm_engine import EngineFeaturesConfig
from stages.common.engines.vllm_states import serve_command
from tests.servers import needs_engine
from tests.test_finetune import read_metrics

COMMON = ["init=scratch", "ttt_steps=3", "micro_batch_size=4", "max_length=48", "lr=3e-3", "log_every=1",
          "val_fraction=0.2"]
VAL_ROWS = 8  # round(0.2 x 48 chats) = 10, in whole micro-batches of 4


def weights(out) -> dict[str, torch.Tensor]:
    return Eagle3Drafter.from_checkpoint(out / "drafter").state_dict()


@pytest.fixture(scope="module")
def offline(engine_target, chats, training_map, tmp_path_factory):
    out = tmp_path_factory.mktemp("online")
    features.run(compose_stage("features", [f"target={engine_target}", f"data={chats}", f"out={out / 'features'}",
                                            "max_length=48"]))
    run = finetune.run(compose_stage("finetune", [f"target={engine_target}", f"vocab_map={training_map}",
                                                  f"features={out / 'features'}", f"out={out / 'offline'}",
                                                  "max_steps=4", *COMMON]))
    return out, run


@needs_engine
def test_an_online_finetune_equals_the_offline_one_and_resumes_asking_only_for_untrained_batches(
        offline, engine_target, chats, training_map):
    out, reference = offline
    online = [f"target={engine_target}", f"vocab_map={training_map}", f"data={chats}", "engine.enabled=true",
              "max_steps=4", *COMMON]
    run = finetune.run(compose_stage("finetune", online + [f"out={out / 'online'}"]))
    first = {name: [m for m in read_metrics(out / name) if m["split"] == "train" and "loss" in m][0]
             for name in ("offline", "online")}
    assert run.metrics["preflight_loss_0"] == pytest.approx(reference.metrics["preflight_loss_0"], rel=1e-5)
    assert first["online"]["loss"] == pytest.approx(first["offline"]["loss"], rel=1e-5)
    assert run.metrics["val_loss"] == pytest.approx(reference.metrics["val_loss"], rel=1e-4)
    expected = weights(out / "offline")
    # vLLM's states and the hf target's differ in their last bits, and every step trains from the first (lr/W, not
    # 0): Adam turns a near-zero gradient's last bits into a step of up to lr (3e-3); measured: 1 weight of 16,384
    # off by 1.8e-5, within 1e-4 (and the losses agree to 1e-5)
    for name, tensor in weights(out / "online").items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # the server computed states for the preflight's batch, 4 steps of 4 rows and one validation, nothing more
    assert run.metrics["engine_rows"] == 4 + 4 * 4 + VAL_ROWS
    assert not list((out / "online.checkpoints" / "engine" / "engine_states").rglob("*.safetensors"))

    stopped = finetune.run(compose_stage("finetune", online + [f"out={out / 'rung'}", "stop_at=2"]))
    assert stopped.metrics["engine_rows"] == 4 + 2 * 4 + VAL_ROWS  # a rung validates where it stops
    resumed = finetune.run(compose_stage("finetune", online + [f"out={out / 'rung'}"]))
    # steps 3 and 4 only, then the validation; the preflight's figures are read back from the run's log, not asked
    assert resumed.metrics["engine_rows"] == 2 * 4 + VAL_ROWS
    for name, tensor in weights(out / "rung").items():
        torch.testing.assert_close(tensor, weights(out / "online")[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_server_that_is_not_there_stops_the_finetune_with_one_line(engine_target, chats, training_map, tmp_path):
    cfg = compose_stage("finetune", [f"target={engine_target}", f"vocab_map={training_map}", f"data={chats}",
                                     f"out={tmp_path / 'ft'}", "engine.enabled=true",
                                     "engine.server_url=http://127.0.0.1:9", *COMMON])
    with pytest.raises(RegraftError, match=r"^http://127.0.0.1:9: no healthy vLLM server answers GET /health"):
        finetune.run(cfg)
    assert not (tmp_path / "ft").exists()


def test_the_server_runs_the_targets_code_only_when_the_stage_trusts_it(target_dir, tmp_path):
    for trusted in (False, True):
        command = serve_command(EngineFeaturesConfig(trust_remote_code=trusted), str(target_dir), [0, 1, 2], 48,
                                tmp_path, 8000)
        assert ("--trust-remote-code" in command) is trusted
