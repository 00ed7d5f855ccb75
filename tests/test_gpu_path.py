"""The fine-tune's GPU path on a machine without a GPU: torch's `meta` device fails exactly as CUDA does when a tensor
stays on the host ("Tensor on device cpu is not on the expected device meta"), so the data path is run with the
drafter on meta, and the target (or its head) and the batches placed by the code a GPU run uses
(`training_rows`, `batches_for`, `run_ttt`): a batch, the target's signals, the TTT step and its backward."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages import features, finetune
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import compose_stage
from stages.common.drafter.target import TargetHead
from stages.common.drafter.vocab import load_vocab_map
from stages.finetune.device import deepspeed_devices, training_device
from stages.finetune.loop import batches_for, micro_batches, run_ttt, split
from tests.conftest import finetune_cfg

META = torch.device("meta")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cached_features(trained_target, chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("meta") / "features"
    features.run(compose_stage("features", [f"target={trained_target}", f"data={chats}", f"out={out}",
                                            "aux_layer_ids=[0,1,2]", "max_length=64"]))
    return out


def first_batch_on(device: torch.device, cfg):
    """The drafter on `device`, its target side placed by `training_rows`, and the first batch as the loop takes it."""
    drafter, _ = finetune.initial_drafter(cfg, load_vocab_map(cfg.vocab_map))
    drafter.to(device)
    target, rows = finetune.training_rows(cfg, drafter, device)
    train_data, _ = split(rows, cfg.val_fraction, cfg.seed)
    batch = next(batches_for(micro_batches(train_data, cfg.micro_batch_size, 0, cfg.seed, 0, 1), cfg, device, None))
    return drafter, target, batch


@pytest.mark.parametrize("family", ["eagle3", "eagle3.1"])
def test_offline_step_runs_where_the_drafter_is(trained_target, chats, training_map, cached_features, tmp_path,
                                                family):
    cfg = finetune_cfg(trained_target, chats, training_map, tmp_path / "out", "init=scratch", f"family={family}",
                       f"features={cached_features}", "max_length=64")
    drafter, head, batch = first_batch_on(META, cfg)
    assert isinstance(head, TargetHead) and head.lm_head.device == META and head.embedding.weight.device == META
    assert batch["aux_hidden"].device.type == "cpu"  # read from the shards on the host; run_ttt moves it
    stats = run_ttt(drafter, head, batch, cfg.ttt_steps, cfg.loss_mask)
    stats.loss.backward()
    assert stats.loss.device == META and stats.correct.shape == (cfg.ttt_steps,)
    trained = [param for param in drafter.parameters() if param.requires_grad]
    assert trained and all(param.grad is not None and param.grad.device == META for param in trained)


def test_online_target_is_placed_where_the_drafter_is(trained_target, chats, training_map, tmp_path):
    """Online without an engine the whole target runs in every step: `training_rows` puts it on the drafter's
    device. Its forward is not run here: transformers' mask builder reads a value (`.item()`), which a GPU gives
    and the meta device cannot."""
    cfg = finetune_cfg(trained_target, chats, training_map, tmp_path / "out", "init=scratch")
    drafter, target, batch = first_batch_on(META, cfg)
    assert {param.device for param in target.model.parameters()} == {META}
    assert target.embed(batch["input_ids"].to(META)).device == META


def test_a_head_left_on_the_host_is_caught(trained_target, chats, training_map, cached_features, tmp_path):
    """What the meta device is here for: the lm_head's vocab-chunked matmul left on the host fails as on a GPU."""
    cfg = finetune_cfg(trained_target, chats, training_map, tmp_path / "out", "init=scratch",
                       f"features={cached_features}", "max_length=64")
    drafter, _, batch = first_batch_on(META, cfg)
    with pytest.raises(RuntimeError, match="meta"):
        run_ttt(drafter, TargetHead(cfg.target), batch, cfg.ttt_steps, cfg.loss_mask)


def test_a_gpu_node_whose_torch_sees_no_gpu_is_refused(monkeypatch):
    """A CPU build of torch on a GPU node would train in fp32 on the CPU for days: refused in one line; asked for
    the CPU, or on a machine without GPUs, it trains there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("stages.finetune.device.gpu_visible", lambda: True)
    with pytest.raises(RegraftError, match="has GPUs .* but torch .* sees none") as refused:
        training_device("auto")
    assert "finetune.device=cpu" in str(refused.value)
    assert training_device("cpu") == torch.device("cpu")
    with pytest.raises(RegraftError, match="sees no GPU"):
        training_device("cuda")
    monkeypatch.setattr("stages.finetune.device.gpu_visible", lambda: False)
    assert training_device("auto") == torch.device("cpu")


def test_deepspeed_is_given_the_gpus_the_job_was_given(monkeypatch):
    """`--num_gpus` would take GPUs 0..N-1 whatever CUDA_VISIBLE_DEVICES says; the job's GPUs are named instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert deepspeed_devices(4, "auto") == ["--include", "localhost:4,5,6,7"]
    assert deepspeed_devices(2, "auto") == ["--include", "localhost:4,5"]
    with pytest.raises(RegraftError, match="given 4 GPU"):
        deepspeed_devices(8, "auto")
    assert deepspeed_devices(2, "cpu") == ["--num_gpus", "2"]  # CPU ranks: DeepSpeed's CPU accelerator counts them
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert deepspeed_devices(8, "auto") == ["--num_gpus", "8"]


def test_live_bytes_counts_storages_while_they_live():
    from stages.common.drafter.memory import LiveBytes

    with LiveBytes() as tracked:
        first = torch.empty(1000, dtype=torch.float32, device=META)  # 4,000 bytes
        second = torch.empty(500, dtype=torch.bfloat16, device=META)  # 1,000
        view = first[:10]  # a view: no new storage
        del first, view
        third = torch.empty(250, dtype=torch.float32, device=META)  # 1,000, after 4,000 were freed
    assert tracked.peak == 5000 and tracked.now == 2000 and second.numel() + third.numel() == 750


@pytest.mark.parametrize("family", ["eagle3", "mla"])
def test_the_kimi_fine_tune_fits_a_b200_and_a_long_one_does_not(family):
    """experiment=kimi_k25's fine-tune (2,048 tokens, 5 TTT steps, micro-batch 1, ZeRO-2 on 8 ranks) in one HGX
    B200's 180 GB, less the headroom; the same at 32,768 tokens does not fit. The step grows about linearly in T (memory-
    efficient attention keeps no [T, T] scores): 4x the tokens cost under 4x the bytes, where quadratic scores
    would cost ~16x."""
    from bench.memory import B200_GB, kimi_drafter
    from stages.common.drafter.memory import fine_tune_memory

    b200 = B200_GB * 1e9
    config = kimi_drafter(family)
    kimi = fine_tune_memory(config, micro_batch=1, seq=2048, ttt_steps=5, zero_stage=2, gpus_per_node=8)
    assert kimi.fits(b200) and 10e9 < kimi.total < 60e9
    assert kimi.target_side == 2 * 163840 * 7168 * 2  # embeddings and lm_head in bf16
    longer = fine_tune_memory(config, micro_batch=1, seq=8192, ttt_steps=5, zero_stage=2, gpus_per_node=8)
    assert 2.0 < longer.step / kimi.step < 4.0
    too_long = fine_tune_memory(config, micro_batch=1, seq=32768, ttt_steps=5, zero_stage=2, gpus_per_node=8)
    assert not too_long.fits(b200)
    alone = fine_tune_memory(config, micro_batch=1, seq=2048, ttt_steps=5, zero_stage=0, gpus_per_node=8)
    assert alone.model_states > 3 * kimi.model_states  # ZeRO-0: every rank keeps every optimizer state


def serve_on_node(rank: int, world: int, port: int, log_dir: str) -> None:
    """One rank of a two-rank job on one node (as Slurm starts them): online features without a server URL."""
    import contextlib
    import os

    from omegaconf import OmegaConf

    from stages.common.engines import vllm_states
    from stages.finetune.device import node_states_server

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo")

    @contextlib.contextmanager
    def standin_server(engine, target, layer_ids, max_length, work):  # the vLLM server's place: a URL, a record
        (Path(log_dir) / f"started-by-{rank}").write_text(str(work))
        yield f"http://127.0.0.1:{9000 + rank}"

    vllm_states.states_server = standin_server
    cfg = OmegaConf.create({"engine": {"enabled": True, "server_url": None}, "target": "t", "max_length": 8,
                            "init": "scratch"})
    import stages.finetune as finetune

    finetune.initial_config = lambda cfg: None
    finetune.aux_layers_of = lambda config: [0, 1, 2]
    with node_states_server(cfg, Path(log_dir)) as served:
        (Path(log_dir) / f"url-of-{rank}").write_text(served.engine.server_url)
    torch.distributed.destroy_process_group()


def test_on_slurm_each_node_starts_one_server_its_ranks_share(tmp_path):
    """A Slurm job's ranks call `run_rank` directly (no launching process starts a server for them): the node's
    first rank starts the target's server, and every rank of the node trains against that one URL."""
    from stages.common.contract.runtime import free_port

    torch.multiprocessing.spawn(serve_on_node, args=(2, free_port(), str(tmp_path)), nprocs=2)
    assert sorted(path.name for path in tmp_path.glob("started-by-*")) == ["started-by-0"]
    assert (tmp_path / "url-of-0").read_text() == (tmp_path / "url-of-1").read_text() == "http://127.0.0.1:9000"


def test_gpu_check_on_a_machine_without_a_gpu_says_what_to_install(tmp_path):
    """`make gpu-check` where torch sees no GPU: one failed row naming the CUDA build to install, exit 1, nothing
    else run (a CPU machine here; the other answer needs a GPU)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--outputs", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 1 and "| torch sees a GPU | FAILED |" in rows[0] and "--index-url" in rows[0]


def test_gpu_check_reads_where_each_fine_tune_trained(tmp_path):
    import json

    from bench.gpu_check import finetunes_on_gpu

    assert finetunes_on_gpu(tmp_path) == ["no fine-tune output"]
    for key, device, precision in (("a", "cuda:0 (NVIDIA B200)", "bf16"), ("b", "cpu", "fp32")):
        (tmp_path / "cache" / "finetune" / key).mkdir(parents=True)
        (tmp_path / "cache" / "finetune" / key / "manifest.json").write_text(
            json.dumps({"device": device, "precision": precision}))
    assert finetunes_on_gpu(tmp_path) == ["b: trained on cpu in fp32"]
