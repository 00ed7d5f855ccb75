"""Feature shards: the writer's two layouts, the streamed row source, what loss_masked may leave out, and memory
that does not grow with the data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages import features, finetune
from stages.common.artifacts import read_manifest, staged_output, write_json_atomic
from stages.common.drafter_config import drafter_config_for
from stages.common.eagle3 import Eagle3Drafter
from stages.common.errors import RegraftError
from stages.common.feature_shards import (LastHidden, ShardWriter, final_state_positions, load_features,
                                          open_features, shard_path, write_shard)
from stages.common.stage import compose_stage
from stages.common.target import TargetHead
from stages.common.ttt import LossMask, loss_gates
from stages.common.vocab import load_vocab_map
from stages.finetune.loop import micro_batches, run_ttt, split

ROOT = Path(__file__).resolve().parents[1]
MiB = 2 ** 20


def answers_mask(rows: int, length: int, seed: int) -> torch.Tensor:
    """Loss masks like chats': a few assistant spans per row, some touching the row's end."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for row in range(rows):
        for _ in range(3):
            start = int(torch.randint(0, length, (1,), generator=generator))
            mask[row, start:start + int(torch.randint(1, length // 3, (1,), generator=generator))] = True
    return mask


def random_rows(rows: int, length: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 100, (rows, length), generator=generator),
            "attention_mask": torch.ones(rows, length, dtype=torch.bool),
            "loss_mask": answers_mask(rows, length, seed),
            "aux_hidden": torch.randn(rows, length, 3 * hidden, generator=generator),
            "last_hidden": torch.randn(rows, length, hidden, generator=generator)}


def write_features(out: Path, rows: dict[str, torch.Tensor], rows_per_shard: int, last_hidden: str,
                   batch: int = 5) -> dict:
    """A features output as the stage writes it: shards by the stage's writer, then its manifest fields."""
    out.mkdir(parents=True)
    writer = ShardWriter(out, rows_per_shard, last_hidden)
    for start in range(0, rows["input_ids"].shape[0], batch):
        writer.add({name: tensor[start:start + batch] for name, tensor in rows.items()})
    metrics = writer.close().metrics()
    write_json_atomic(out / "manifest.json", {"stage": "features", "complete": True, "aux_layer_ids": [1, 2, 3],
                                              "max_length": rows["input_ids"].shape[1], "last_hidden": last_hidden,
                                              "metrics": metrics})
    return metrics


def test_final_state_positions_cover_every_loss_rule():
    """Every position whose final state (the target's logits at j = t+1+k) a gate admits, for each rule and
    unroll length, is one the loss_masked layout keeps; elsewhere nothing reads it."""
    mask = answers_mask(64, 40, seed=3)
    mask[:, -1] = True  # answers running to the row's end
    keep = final_state_positions(mask)
    for rule in LossMask:
        for steps in (1, 3, 7):
            for k, gate in enumerate(loss_gates(mask, rule, steps)):
                assert keep[:, 1 + k:][gate].all(), (rule, steps, k)
    assert keep.sum() < mask.numel() * 0.8 and torch.equal(keep & mask, mask)


@pytest.mark.parametrize("last_hidden", ["all", "loss_masked"])
def test_rows_come_back_as_written_from_any_shards_in_any_order(tmp_path, last_hidden):
    rows = random_rows(23, 12, 8, seed=0)
    metrics = write_features(tmp_path / "f", rows, rows_per_shard=4, last_hidden=last_hidden)
    assert metrics["shards"] == 6 and len(list((tmp_path / "f").glob("features-*.safetensors"))) == 6
    source = open_features(tmp_path / "f", [1, 2, 3], 12)
    assert len(source) == 23
    picked = torch.tensor([22, 0, 5, 4, 5, 13, 7, 21, 1])  # across shards, out of order, one twice
    taken = source.take(picked)
    expected = {name: tensor[picked] for name, tensor in rows.items()}
    if last_hidden == "loss_masked":
        expected["last_hidden"] = expected["last_hidden"] * final_state_positions(expected["loss_mask"])[..., None]
    assert taken.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(taken[name], tensor), name
    every = load_features(tmp_path / "f", [1, 2, 3], 12)
    assert torch.equal(every["aux_hidden"], rows["aux_hidden"])


def test_loss_masked_shards_store_only_the_kept_final_states(tmp_path):
    rows = random_rows(30, 16, 8, seed=1)
    full = write_features(tmp_path / "all", rows, 10, "all")
    masked = write_features(tmp_path / "masked", rows, 10, "loss_masked")
    kept = int(final_state_positions(rows["loss_mask"]).sum())
    assert full["bytes_per_token"] == 4 * 8 * 4 and full["final_states_stored"] == 1.0
    assert masked["final_states_stored"] == kept / rows["loss_mask"].numel()
    assert masked["bytes_per_token"] == (3 * 8 + 8 * kept / rows["loss_mask"].numel()) * 4
    saved = (rows["loss_mask"].numel() - kept) * 8 * 4  # the final states left out
    overhead = (30 + 3) * 8 + 3 * 128  # less the offsets (8 bytes a row, +1 a shard) and longer headers
    assert saved - overhead < full["bytes"] - masked["bytes"] < saved


def test_opening_checks_the_manifest_and_the_shards(tmp_path):
    rows = random_rows(4, 12, 8, seed=2)
    write_features(tmp_path / "f", rows, 4, "loss_masked")
    with pytest.raises(RegraftError, match=r"cached for aux layers \[1, 2, 3\] and max_length 12"):
        open_features(tmp_path / "f", [0, 1, 2], 12)
    with pytest.raises(RegraftError, match="not a complete features stage output"):
        open_features(tmp_path, [1, 2, 3], 12)
    write_shard(shard_path(tmp_path / "f", 0), rows)  # a last_hidden=all shard where the manifest says loss_masked
    with pytest.raises(RegraftError, match="a last_hidden=loss_masked shard holds"):
        open_features(tmp_path / "f", [1, 2, 3], 12)


def test_a_finetune_on_loss_masked_features_matches_one_on_all(trained_target, chats, training_map, tmp_path):
    """Same step-0 numbers for every loss rule, the same trained weights, and files smaller by the final states of
    the positions no loss reads."""
    stored = {}
    for mode in LastHidden:
        result = features.run(compose_stage("features", [f"target={trained_target}", f"data={chats}",
                                                         f"out={tmp_path / mode.value}", "max_length=48",
                                                         "rows_per_shard=16", f"last_hidden={mode.value}"]))
        stored[mode] = result.metrics
        assert read_manifest(tmp_path / mode.value)["last_hidden"] == mode.value
    full, masked = stored[LastHidden.all], stored[LastHidden.loss_masked]
    hidden = json.loads((trained_target / "config.json").read_text())["hidden_size"]
    assert full["bytes_per_token"] == 4 * hidden * 4  # fp32 on CPU
    skipped = (1 - masked["final_states_stored"]) * full["rows"] * 48  # positions without a final state
    assert full["bytes"] - masked["bytes"] == pytest.approx(skipped * hidden * 4, rel=0.02)
    assert masked["bytes_per_token"] == (3 + masked["final_states_stored"]) * hidden * 4
    assert 0 < masked["final_states_stored"] < 0.8  # these chats: 0.75 (long answers, one short question)

    drafter = Eagle3Drafter.initialised(drafter_config_for(trained_target, 64), load_vocab_map(training_map), seed=0)
    layers = read_manifest(tmp_path / "all")["aux_layer_ids"]
    head = TargetHead(trained_target)
    sources = {mode: open_features(tmp_path / mode.value, layers, 48) for mode in LastHidden}
    with torch.no_grad():
        for rule in LossMask:
            batches = [next(micro_batches(split(sources[mode], 0.2, 0)[0], 8, 0, 0, 0, 1)) for mode in LastHidden]
            a, b = (run_ttt(drafter, head, batch, 3, rule) for batch in batches)
            assert a.metrics() == b.metrics() and a.valid.sum() > 0, rule

    common = [f"target={trained_target}", f"vocab_map={training_map}", "init=scratch", "ttt_steps=3",
              "micro_batch_size=4", "max_length=48", "lr=3e-3", "val_fraction=0.2", "max_steps=4"]
    runs = {mode: finetune.run(compose_stage("finetune", common + [f"features={tmp_path / mode.value}",
                                                                   f"out={tmp_path / ('ft_' + mode.value)}"]))
            for mode in LastHidden}
    assert {"preflight_loss_0", "preflight_full_acc_0", "val_loss"} <= set(runs[LastHidden.all].metrics)
    assert runs[LastHidden.all].metrics == runs[LastHidden.loss_masked].metrics  # preflight step-0 and val numbers
    weights = {mode: Eagle3Drafter.from_checkpoint(tmp_path / f"ft_{mode.value}" / "drafter").state_dict()
               for mode in LastHidden}
    for name, tensor in weights[LastHidden.all].items():
        assert torch.equal(tensor, weights[LastHidden.loss_masked][name]), name


# ---------------------------------------------------------------- memory

RSS_LENGTH, RSS_BATCH = 128, 128  # tokens per row, rows per micro-batch
# Imports torch, DeepSpeed and the stage once (most of a fine-tune's start on 2 busy cores), then forks one child
# per fine-tune, as pipelines/warm.py does (no torch op runs before a fork); prints each child's peak RSS (wait4).
PEAK_RSS_RUNNER = """
import json, os, sys, traceback
from stages import finetune
from stages.common.stage import compose_stage
finetune.use_built_cpu_ops()
import deepspeed  # noqa: F401
peaks = []
for overrides in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            finetune.run(compose_stage("finetune", overrides))
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"fine-tune {overrides} failed")
    peaks.append(usage.ru_maxrss * 1024)  # Linux reports KiB
print(json.dumps(peaks))
"""


def synthetic_features(out: Path, target: Path, rows: int) -> int:
    """A features output for `target` as the stage writes it (its writer, its manifest fields), one row per shard,
    states of the target's width (the same random ones in every row: only their size matters here); returns the
    shards' bytes."""
    config = drafter_config_for(target, 64)
    generator = torch.Generator().manual_seed(0)
    aux = torch.randn(1, RSS_LENGTH, 3 * config.hidden_size, generator=generator)
    last = torch.randn(1, RSS_LENGTH, config.hidden_size, generator=generator)
    cfg = compose_stage("features", [f"target={target}", "data=synthetic", f"out={out}", f"max_length={RSS_LENGTH}",
                                     "rows_per_shard=1"])
    with staged_output(out, "features", cfg) as staged:
        writer = ShardWriter(staged.path, 1)
        for row in range(rows):
            writer.add({"input_ids": torch.randint(0, config.vocab_size, (1, RSS_LENGTH), generator=generator),
                        "attention_mask": torch.ones(1, RSS_LENGTH, dtype=torch.bool),
                        "loss_mask": answers_mask(1, RSS_LENGTH, row), "aux_hidden": aux, "last_hidden": last})
        stored = writer.close()
        staged.update(metrics={"rows": rows, **stored.metrics()}, aux_layer_ids=config.aux_layer_ids,
                      aux_convention=config.aux_convention, max_length=RSS_LENGTH, last_hidden="all")
    return stored.bytes


@pytest.mark.slow
def test_offline_finetune_memory_does_not_grow_with_the_shards(target_dir, training_map, tmp_path):
    """A one-epoch finetune over 150 MiB of features in 2,400 one-row shards peaks within 24 MiB of the same
    finetune over 320 rows (20 MiB), both with full micro-batches (128 rows x 64 KiB = 8 MiB) in training and
    validation: the row source reads one micro-batch at a time and closes every shard after it, so only
    batch-sized buffers come and go, besides ~1 KiB of index per shard. Measured here: +6 MiB. 24 MiB is a sixth
    of the set; loading the set, as the finetune did before, adds all of it.

    glibc's malloc is given a fixed mmap threshold: by default it raises the threshold to the largest block freed,
    after which freed batch buffers may linger in its heap, by chance, by up to a few batches (+8 to +26 MiB between
    repeated runs of these same two fine-tunes); fixed, peak RSS tracks what is alive."""
    sizes = {name: synthetic_features(tmp_path / name, target_dir, rows) for name, rows in (("small", 320),
                                                                                            ("large", 2400))}
    assert sizes["large"] > 145 * MiB
    runs = [[f"target={target_dir}", f"vocab_map={training_map}", f"features={tmp_path / name}",
             f"out={tmp_path / ('ft_' + name)}", "init=scratch", "ttt_steps=1", f"micro_batch_size={RSS_BATCH}",
             f"max_length={RSS_LENGTH}", "val_fraction=0.4", "epochs=1", "log_every=1000"] for name in sizes]
    done = subprocess.run([sys.executable, "-c", PEAK_RSS_RUNNER, json.dumps(runs)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
    assert done.returncode == 0, done.stderr[-3000:]
    small, large = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"features {sizes['large'] / MiB:.0f} MiB; peak RSS {small / MiB:.0f} MiB (small), {large / MiB:.0f} MiB")
    assert large < small + 24 * MiB, (small / MiB, large / MiB)
