"""finetune on the real DeepSpeed engine (CPU, gloo, in process): learning, the guard, export."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stages import features, finetune, remap
from stages.common.contract.stage import compose_stage
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.drafter.vocab import VocabMap, load_vocab_map
from stages.finetune import loop
from tests.conftest import finetune_cfg


ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PYTHON = ROOT / ".venv-ref" / "bin" / "python"


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_scratch_finetune_learns_and_exports(scratch_run, training_map):
    out, result = scratch_run
    metrics = read_metrics(out)
    train = [m for m in metrics if m["split"] == "train"]
    # every train series at the same steps, every log_every (2) and the last: a loss point has its lr beside it
    assert [m["step"] for m in train] == [*range(2, 28, 2), 27]
    assert all({"lr", "grad_norm", "loss", "full_acc_0"} <= set(m) for m in train)
    val = [m for m in metrics if m["split"] == "val"]
    assert len(val) == 3 and train[0]["step"] == 2 and train[-1]["step"] == 27  # 38 train chats / 4 = 9 per epoch
    assert train[-1]["loss"] < 0.6 * train[0]["loss"]
    assert val[0]["full_acc_0"] < val[-1]["full_acc_0"] and val[-1]["full_acc_0"] > 0.5
    assert val[-1]["sim_accept_len"] > 1.5
    assert {"lr", "grad_norm", "tokens_per_s", "cond_acc_2", "sim_accept_len"} <= set(train[-1])
    exported = Eagle3Drafter.from_checkpoint(out / "drafter")
    assert torch.equal(exported.d2t, load_vocab_map(training_map).d2t)
    assert result.metrics["val_loss"] == min(m["loss"] for m in val)


def shifted_map(vocab_map_dir: Path, tmp_path: Path) -> Path:
    """The same tokens and three others: every later draft position now names a different token."""
    old = load_vocab_map(vocab_map_dir)
    unused = [i for i in range(old.vocab_size) if not old.t2d[i]][-3:]
    moved = VocabMap.from_target_ids(torch.tensor(sorted(old.target_ids[3:].tolist() + unused)), old.vocab_size)
    torch.save({"d2t": moved.d2t, "t2d": moved.t2d}, tmp_path / "moved.pt")
    return tmp_path / "moved.pt"


def test_guard_stops_as_is_and_remap_fixes_it(scratch_run, trained_target, chats, training_map, tmp_path):
    """The cautionary tale: a trained drafter read through another map's ordering starts near chance."""
    trained_drafter = scratch_run[0] / "drafter"
    new_map = shifted_map(training_map, tmp_path)
    with pytest.raises(RegraftError, match=r"only \d+ of 64 draft positions map to the same target token") as error:
        finetune.run(finetune_cfg(trained_target, chats, new_map, tmp_path / "as_is", "init=as_is",
                                  f"drafter={trained_drafter}"))
    assert "run remap" in str(error.value) and not (tmp_path / "as_is").exists()

    consented = finetune.run(finetune_cfg(trained_target, chats, new_map, tmp_path / "as_is", "init=as_is",
                                          f"drafter={trained_drafter}", "guard.consent=true", "max_steps=1"))
    assert consented.metrics["preflight_misaligned"] > 0.5
    assert consented.metrics["preflight_full_acc_0"] < 0.1 < 0.4 < consented.metrics["preflight_remapped_full_acc_0"]

    remapped = tmp_path / "remapped"
    remap.run(compose_stage("remap", [f"drafter={trained_drafter}", f"vocab_map={new_map}",
                                      f"verifier={trained_target}", f"out={remapped}"]))
    fixed = finetune.run(finetune_cfg(trained_target, chats, new_map, tmp_path / "remap", "init=remap",
                                      f"drafter={remapped}", "max_steps=1"))
    assert fixed.metrics["preflight_misaligned"] == 0.0
    assert fixed.metrics["preflight_loss_0"] < 0.5 * consented.metrics["preflight_loss_0"]
    assert fixed.metrics["preflight_full_acc_0"] > 0.4


def signalled_at_first_step(command: list[str], metrics: Path, signum: int) -> tuple[int, str]:
    """Run a fine-tune command, send it `signum` once its first train line is logged; its exit code and stderr."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and '"split": "train"' in metrics.read_text():
            process.send_signal(signum)
            break
        time.sleep(0.02)
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


def test_resume_after_a_stop_ends_with_the_same_weights(trained_target, chats, training_map, tmp_path):
    overrides = [f"target={trained_target}", f"data={chats}", f"vocab_map={training_map}", "init=scratch",
                 "ttt_steps=3", "micro_batch_size=4", "max_length=48", "lr=3e-3", "log_every=1",
                 "val_fraction=0.2", "epochs=4", "checkpoint_every=1000", "deepspeed.warmup_ratio=0.1"]
    checkpointing = [item if not item.startswith("checkpoint_every=") else "checkpoint_every=5" for item in overrides]
    finetune.run(compose_stage("finetune", checkpointing + [f"out={tmp_path / 'straight'}"]))
    saved = tmp_path / "straight.checkpoints" / "deepspeed"  # 36 steps, saved at 5, 10, ..., 35; the 2 newest kept
    assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == ["step30", "step35"]
    assert (saved / "latest").read_text() == "step35"

    command = [sys.executable, "-m", "stages.finetune", *overrides, f"out={tmp_path / 'stopped'}"]
    metrics = tmp_path / "stopped.checkpoints" / "metrics.jsonl"
    returncode, stderr = signalled_at_first_step(command, metrics, signal.SIGTERM)
    assert returncode == 1 and "stopped by a signal at step" in stderr, stderr[-2000:]
    stopped_at = int(stderr.split("stopped by a signal at step ")[1].split()[0])
    assert 1 <= stopped_at < 36 and not (tmp_path / "stopped").exists()

    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    straight = Eagle3Drafter.from_checkpoint(tmp_path / "straight" / "drafter").state_dict()
    after_stop = Eagle3Drafter.from_checkpoint(tmp_path / "stopped" / "drafter").state_dict()
    for name, tensor in straight.items():
        assert torch.allclose(tensor, after_stop[name], atol=1e-6), name
    steps = [m["step"] for m in read_metrics(tmp_path / "stopped") if m["split"] == "train"]
    assert steps == list(range(1, 37))  # every step once: none repeated, none missing


REQUEUE_STANDIN = """
import os, runpy, signal, sys
marker = sys.argv[1]
def requeue(signum, frame):  # a stand-in for submitit's time-limit handler, which requeues the job and exits
    open(marker, "w").write("requeued")
    os._exit(3)
signal.signal(signal.SIGUSR2, requeue)
sys.argv = ["stages.finetune", *sys.argv[2:]]
runpy.run_module("stages.finetune", run_name="__main__")
"""


@pytest.mark.parametrize("handler", ["submitit", "none"])
def test_time_limit_signal_checkpoints_the_step_before_the_requeue(trained_target, chats, training_map, tmp_path,
                                                                    handler):
    """Slurm's time-limit warning (SIGUSR2): the fine-tune saves a checkpoint at its next step, then lets the handler
    it found (submitit's: requeue, exit) run, so a requeued job resumes where it stopped, not at the last periodic
    checkpoint; with no handler there, it stops as on SIGTERM."""
    overrides = [f"target={trained_target}", f"data={chats}", f"vocab_map={training_map}", "init=scratch",
                 "ttt_steps=2", "micro_batch_size=4", "max_length=48", "log_every=1", "val_fraction=0.2",
                 "epochs=8", "checkpoint_every=1000", f"out={tmp_path / 'out'}"]
    marker = tmp_path / "requeued"
    command = [sys.executable, "-c", REQUEUE_STANDIN, str(marker), *overrides] if handler == "submitit" else \
        [sys.executable, "-m", "stages.finetune", *overrides]
    metrics = tmp_path / "out.checkpoints" / "metrics.jsonl"
    returncode, stderr = signalled_at_first_step(command, metrics, signal.SIGUSR2)
    saved = (tmp_path / "out.checkpoints" / "deepspeed" / "latest").read_text()
    last_step = max(m["step"] for m in map(json.loads, metrics.read_text().splitlines()) if m["split"] == "train")
    assert saved == f"step{last_step}" and last_step < 80  # the step it stopped at, not a periodic checkpoint
    if handler == "submitit":
        assert returncode == 3 and marker.read_text() == "requeued", stderr[-2000:]
    else:
        assert returncode == 1 and "stopped by a signal at step" in stderr and not marker.exists()


# ZeRO-3 reduce-scatters partitioned gradients: the sums run in another order than one rank's accumulation, and
# Adam turns the last-bit differences of near-zero gradients into steps of up to lr (3e-3) per weight, on every step
# from the first (the warmup is linear from lr/W): 0.3% of val loss after this run's steps.
@pytest.mark.parametrize("spawn,zero_stage,rel,atol", [("torchrun", 0, 1e-4, 1e-5), ("deepspeed", 3, 5e-3, 2e-2)])
def test_two_ranks_match_one_rank_with_the_same_global_batch(trained_target, chats, training_map, tmp_path,
                                                             spawn, zero_stage, rel, atol):
    common = [f"target={trained_target}", f"data={chats}", f"vocab_map={training_map}", "init=scratch",
              "ttt_steps=3", "micro_batch_size=4", "max_length=48", "lr=3e-3", "log_every=1", "val_fraction=0.2",
              "epochs=2", "deepspeed.warmup_ratio=0.1", f"deepspeed.zero_stage={zero_stage}"]
    one = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'one'}",
                                                          "deepspeed.gradient_accumulation_steps=2"]))
    two = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'two'}", f"spawn={spawn}", "nproc=2"]))
    assert two.metrics["val_loss"] == pytest.approx(one.metrics["val_loss"], rel=rel)
    weights_one = Eagle3Drafter.from_checkpoint(tmp_path / "one" / "drafter").state_dict()
    weights_two = Eagle3Drafter.from_checkpoint(tmp_path / "two" / "drafter").state_dict()
    for name, tensor in weights_one.items():
        assert torch.allclose(tensor, weights_two[name], atol=atol), name
    steps = [m["step"] for m in read_metrics(tmp_path / "two") if m["split"] == "train"]
    assert steps == list(range(1, 9))


def test_offline_features_give_the_same_losses_as_online(trained_target, chats, training_map, tmp_path):
    cached = tmp_path / "features"
    result = features.run(compose_stage("features", [f"target={trained_target}", f"data={chats}", f"out={cached}",
                                                     "max_length=48", "rows_per_shard=16"]))
    assert result.metrics["rows"] == 48 and result.metrics["shards"] == 3
    common = [f"target={trained_target}", f"vocab_map={training_map}", "init=scratch", "ttt_steps=3",
              "micro_batch_size=4", "max_length=48", "lr=3e-3", "log_every=1", "val_fraction=0.2", "max_steps=4"]
    online = finetune.run(compose_stage("finetune", common + [f"data={chats}", f"out={tmp_path / 'online'}"]))
    offline = finetune.run(compose_stage("finetune", common + [f"features={cached}", f"out={tmp_path / 'offline'}"]))
    online_steps = [m for m in read_metrics(tmp_path / "online") if m["split"] == "train"]
    offline_steps = [m for m in read_metrics(tmp_path / "offline") if m["split"] == "train"]
    assert [m["step"] for m in offline_steps] == [1, 2, 3, 4]
    for a, b in zip(online_steps, offline_steps):  # step 1 reports the loss before any update: step 0's
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["full_acc_0"] == a["full_acc_0"]
    assert offline.metrics["val_loss"] == pytest.approx(online.metrics["val_loss"], rel=1e-5)


def test_zero3_trains_and_exports_like_zero0(trained_target, chats, training_map, tmp_path):
    common = [f"target={trained_target}", f"data={chats}", f"vocab_map={training_map}", "init=scratch",
              "ttt_steps=2", "micro_batch_size=4", "max_length=48", "lr=3e-3", "val_fraction=0.2", "max_steps=3"]
    zero0 = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'z0'}"]))
    zero3 = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'z3'}", "deepspeed.zero_stage=3"]))
    assert zero3.metrics["val_loss"] == pytest.approx(zero0.metrics["val_loss"], rel=1e-5)
    a = Eagle3Drafter.from_checkpoint(tmp_path / "z0" / "drafter").state_dict()
    b = Eagle3Drafter.from_checkpoint(tmp_path / "z3" / "drafter").state_dict()  # gathered, not empty partitions
    for name, tensor in a.items():
        assert torch.allclose(tensor, b[name], atol=1e-6), name


@pytest.mark.parametrize("preset", ["zero0", "zero2", "zero3"])
def test_each_deepspeed_preset_reaches_the_engine(preset):
    """The pipeline's composed finetune config, through deepspeed_config, into a real engine."""
    import deepspeed
    from hydra import compose, initialize_config_dir

    import pipelines.regraft  # noqa: F401  (registers every schema)
    from stages.common.contract.stage import CONF_DIR
    from stages.finetune import init_distributed
    from stages.finetune.loop import deepspeed_config, lr_schedule

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"deepspeed={preset}"]).finetune
    device = init_distributed(False, 0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   lr_scheduler=lr_schedule(cfg, total_steps=100),
                                                   config=deepspeed_config(cfg, total_steps=100, device=device))
    assert engine.zero_optimization_stage() == int(preset[-1])
    assert engine.gradient_clipping() == cfg.deepspeed.gradient_clipping == 0.5
    assert engine.lr_scheduler is scheduler  # stepped, and checkpointed, by the engine
    lrs = []
    for _ in range(7):
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        scheduler.step()
    assert lrs == pytest.approx([cfg.lr * k / 5 for k in (1, 2, 3, 4, 5)] + [cfg.lr, cfg.lr * 0.99973], rel=1e-4)

    assert engine.gradient_accumulation_steps() == cfg.deepspeed.gradient_accumulation_steps


def specforge_lrs(total_steps: int, warmup_ratio: float) -> list[float]:
    """The lr (a share of the peak) SpecForge 0.2.0's own scheduler gives each optimizer step, run in the reference
    venv."""
    if not REFERENCE_PYTHON.exists():
        pytest.skip("no reference venv with SpecForge 0.2.0: run `make venv-ref`")
    ran = subprocess.run([str(REFERENCE_PYTHON), str(ROOT / "tests" / "specforge_lr.py"), str(total_steps),
                          str(warmup_ratio)], check=True, capture_output=True, text=True, timeout=120)
    return json.loads(ran.stdout)


@pytest.mark.reference
@pytest.mark.parametrize(("total_steps", "warmup_ratio"), [(6, 0.5), (48, 0.015), (200, 0.015)])
def test_lr_schedule_is_specforges(total_steps, warmup_ratio):
    """Linear warmup from lr/W at the first step, then a half cosine to 0, step for step SpecForge's: equal over the
    warmup; after it SpecForge's scheduler runs torch's recursive CosineAnnealingLR from the peak the warmup left in
    the optimizer, which scales every later step by 2 / (1 + cos(pi / (T - W))) (1.001 at T - W = 48); regraft keeps
    the closed form SpecForge's docstring states, so its peak is the lr asked for."""
    warmup = loop.warmup_steps(total_steps, warmup_ratio)
    ours = [loop.lr_factor(step, total_steps, warmup) for step in range(total_steps)]
    theirs = specforge_lrs(total_steps, warmup_ratio)
    overshoot = 2 / (1 + math.cos(math.pi / (total_steps - warmup)))
    assert ours[:warmup] == pytest.approx(theirs[:warmup], rel=1e-12)
    assert [their / overshoot for their in theirs[warmup:]] == pytest.approx(ours[warmup:], rel=1e-9, abs=1e-12)
    assert ours[0] > 0 and max(ours) == 1.0 and ours[-1] < ours[0]


def test_race_warmup_is_the_finetunes():
    from pipelines.modes import race

    assert [race.warmup_steps(budget, 0.015) for budget in (48, 128, 200, 1000)] == \
        [loop.warmup_steps(budget, 0.015) for budget in (48, 128, 200, 1000)] == [0, 1, 3, 15]


def test_train_lines_carry_the_lr_each_step_used_and_the_norm_clipping_saw(trained_target, chats, training_map,
                                                                            tmp_path):
    """lr is read before the scheduler moves on (the first step at lr/W, none at 0); the gradient norm is the real
    one under ZeRO-0 fp32 (where DeepSpeed reports none) and agrees with ZeRO-2's."""
    norms = {}
    for zero in (0, 2):
        out = tmp_path / f"zero{zero}"
        finetune.run(finetune_cfg(trained_target, chats, training_map, out, "init=scratch", "max_steps=6",
                                  "log_every=1", f"deepspeed.zero_stage={zero}", "deepspeed.warmup_ratio=0.5"))
        train = [m for m in read_metrics(out) if m["split"] == "train"]
        norms[zero] = [m["grad_norm"] for m in train]
        peak = 3e-3  # finetune_cfg's lr
        assert [m["lr"] for m in train] == pytest.approx([peak * loop.lr_factor(step, 6, 3) for step in range(6)])
        assert [m["lr"] for m in train][:4] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3])
    assert all(norm > 0 for norm in norms[0]) and len(set(norms[0])) == len(norms[0])
    assert norms[0] == pytest.approx(norms[2], rel=1e-4)


def test_bf16_trains_on_float32_target_states_as_float32_does(trained_target, chats, training_map, tmp_path):
    """deepspeed.bf16 casts only the drafter: the target's float32 states (and cached ones of any dtype) are read in
    the drafter's dtype, and the losses stay those of float32 to bf16's precision."""
    common = [f"target={trained_target}", f"data={chats}", f"vocab_map={training_map}", "init=scratch",
              "ttt_steps=2", "micro_batch_size=4", "max_length=48", "lr=3e-3", "val_fraction=0.2", "max_steps=3",
              "deepspeed.zero_stage=2"]
    fp32 = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'fp32'}", "deepspeed.bf16=false"]))
    bf16 = finetune.run(compose_stage("finetune", common + [f"out={tmp_path / 'bf16'}", "deepspeed.bf16=true"]))
    assert bf16.metrics["val_loss"] == pytest.approx(fp32.metrics["val_loss"], rel=2e-2)
    assert bf16.metrics["val_loss"] != fp32.metrics["val_loss"]  # it did train in bf16


def preflight_of_rank(rank: int, port: int, folders: list[str], found: str) -> None:
    """One rank of two resuming a run: each handed its own view of the work folder, as a rank that read it while
    rank 0 rewrote metrics.jsonl would see it (rank 1's is empty)."""
    import os

    from stages.finetune import guard

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo")
    figures = guard.checked_once(None, None, None, None, None, None, Path(folders[rank]))
    Path(found, f"rank{rank}.json").write_text(json.dumps(figures))
    torch.distributed.destroy_process_group()


def test_every_rank_of_a_resumed_run_gets_rank_0s_preflight_figures(tmp_path):
    """Only rank 0 reads the log back; the others get its figures, whatever they would have read themselves."""
    from stages.common.contract.runtime import free_port

    logged, empty = tmp_path / "rank0", tmp_path / "rank1"
    logged.mkdir()
    empty.mkdir()
    (logged / "metrics.jsonl").write_text(json.dumps({"step": 0, "split": "preflight", "preflight_loss_0": 1.5}) + "\n")
    torch.multiprocessing.spawn(preflight_of_rank, args=(free_port(), [str(logged), str(empty)], str(tmp_path)),
                                nprocs=2)
    assert [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)] == \
        [{"preflight_loss_0": 1.5}] * 2


def test_the_kimi_settings_load_no_deepspeed_op_but_the_cpu_all_reduce(trained_target, chats, training_map, tmp_path,
                                                                        monkeypatch):
    """Nothing in a fine-tune needs a compiler on a GPU node: under the experiment's ZeRO-2 and bf16 the only
    DeepSpeed op loaded is the shared-memory all-reduce of CPU ranks (built at install; NCCL replaces it on GPUs).
    The optimizer is torch's AdamW handed to DeepSpeed, so none of DeepSpeed's JIT-built fused optimizers is asked
    for; a config that named one (`optimizer: {type: Adam}`) would build FusedAdam with nvcc at the first step."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    loaded: list[str] = []
    load = OpBuilder.load

    def recorded(self, *args, **kwargs):
        loaded.append(self.name)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(OpBuilder, "load", recorded)
    cfg = compose_stage("finetune", [f"target={trained_target}", f"data={chats}", f"vocab_map={training_map}",
                                     "init=scratch", "ttt_steps=2", "micro_batch_size=4", "max_length=48",
                                     "val_fraction=0.2", "max_steps=2", "deepspeed.zero_stage=2",
                                     "deepspeed.bf16=true", f"out={tmp_path / 'out'}"])
    finetune.run(cfg)
    assert set(loaded) <= {"deepspeed_shm_comm"}, loaded
    from stages.finetune.loop import deepspeed_config, lr_schedule

    assert "optimizer" not in deepspeed_config(cfg, total_steps=2, device=torch.device("cpu"))


def test_a_deepspeed_config_that_names_an_optimizer_would_build_one():
    """The other answer, so the spy above is known to see a build: DeepSpeed given `optimizer: {type: Adam}` asks for
    its JIT-built fused_adam op (nvcc on a GPU node) at initialize; the spy stops it before any compile."""
    import deepspeed
    from deepspeed.ops.op_builder.builder import OpBuilder

    from stages.finetune import init_distributed

    class Asked(Exception):
        pass

    load = OpBuilder.load

    def refuse_builds(self, *args, **kwargs):
        if self.name != "deepspeed_shm_comm":  # gloo's CPU all-reduce, built at install
            raise Asked(self.name)
        return load(self, *args, **kwargs)

    init_distributed(False, 0)
    model = torch.nn.Linear(8, 8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OpBuilder, "load", refuse_builds)
        with pytest.raises(Asked, match="fused_adam"):
            deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                 config={"train_micro_batch_size_per_gpu": 1,
                                         "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
