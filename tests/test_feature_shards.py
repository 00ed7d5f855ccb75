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
from stages.common.contract.artifacts import read_manifest, staged_output, write_json_atomic
from stages.common.drafter.config import drafter_config_for
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.data.feature_shards import (LastHidden, Layout, ShardWriter, final_state_positions,
                                               load_features, open_features, shard_path, stored_positions,
                                               write_shard)
from stages.common.contract.stage import check_config, compose_stage
from stages.common.drafter.target import TargetHead
from stages.common.drafter.tensor_io import read_header
from stages.common.drafter.ttt import LossMask, loss_gates
from stages.common.drafter.vocab import load_vocab_map
from stages.finetune.loop import micro_batches, run_ttt, split
from stages.schemas.features import FeaturesConfig

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


PAD = 7


def random_rows(rows: int, length: int, hidden: int, seed: int, ragged: bool = False) -> dict[str, torch.Tensor]:
    """Rows as the target ran them; `ragged`: right-padded to `length` (some full, some of one token), the pads
    with the pad id and no loss, their states what a target computes there (not zeros)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=generator) if ragged else torch.full((rows,), length)
    lengths[:2] = torch.tensor([length, 1])[:rows] if ragged else lengths[:2]
    real = torch.arange(length)[None] < lengths[:, None]
    return {"input_ids": torch.randint(0, 100, (rows, length), generator=generator).where(real, PAD),
            "attention_mask": real,
            "loss_mask": answers_mask(rows, length, seed) & real,
            "aux_hidden": torch.randn(rows, length, 3 * hidden, generator=generator),
            "last_hidden": torch.randn(rows, length, hidden, generator=generator)}


def as_read(rows: dict[str, torch.Tensor], layout: str, last_hidden: str) -> dict[str, torch.Tensor]:
    """What a take returns for written `rows`: ragged rows hold zeros past the position after their tokens, and
    loss_masked ones zero final states where no loss reads them."""
    rows = dict(rows)
    if layout == "ragged":
        stored = stored_positions(rows["attention_mask"])[1]
        rows.update({name: rows[name] * stored[..., None] for name in ("aux_hidden", "last_hidden")})
    if last_hidden == "loss_masked":
        rows["last_hidden"] = rows["last_hidden"] * final_state_positions(rows["loss_mask"])[..., None]
    return rows


def write_features(out: Path, rows: dict[str, torch.Tensor], rows_per_shard: int, last_hidden: str,
                   batch: int = 5, layout: str = "ragged") -> dict:
    """A features output as the stage writes it: shards by the stage's writer, then its manifest fields."""
    out.mkdir(parents=True)
    writer = ShardWriter(out, rows_per_shard, last_hidden, layout)
    for start in range(0, rows["input_ids"].shape[0], batch):
        writer.add({name: tensor[start:start + batch] for name, tensor in rows.items()})
    metrics = writer.close().metrics()
    write_json_atomic(out / "manifest.json", {"stage": "features", "complete": True, "aux_layer_ids": [1, 2, 3],
                                              "max_length": rows["input_ids"].shape[1], "last_hidden": last_hidden,
                                              "layout": layout, "metrics": metrics})
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


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("last_hidden", ["all", "loss_masked"])
def test_rows_come_back_as_written_from_any_shards_in_any_order(tmp_path, last_hidden, layout):
    rows = random_rows(23, 12, 8, seed=0, ragged=True)
    metrics = write_features(tmp_path / "f", rows, rows_per_shard=4, last_hidden=last_hidden, layout=layout)
    assert metrics["shards"] == 6 and len(list((tmp_path / "f").glob("features-*.safetensors"))) == 6
    source = open_features(tmp_path / "f", [1, 2, 3], 12)
    assert len(source) == 23
    picked = torch.tensor([22, 0, 5, 4, 5, 13, 7, 21, 1])  # across shards, out of order, one twice
    taken = source.take(picked)
    expected = {name: tensor[picked] for name, tensor in as_read(rows, layout, last_hidden).items()}
    assert taken.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(taken[name], tensor), name
    every = load_features(tmp_path / "f", [1, 2, 3], 12)
    assert torch.equal(every["aux_hidden"], as_read(rows, layout, last_hidden)["aux_hidden"])


def test_ragged_shards_store_the_tokens_and_one_position_after_each_row(tmp_path):
    rows = random_rows(40, 16, 8, seed=4, ragged=True)
    ragged, padded = (write_features(tmp_path / layout, rows, 10, "all", layout=layout)
                      for layout in ("ragged", "padded"))
    lengths = rows["attention_mask"].sum(1)
    assert ragged["stored_positions"] == int((lengths + 1).clamp(max=16).sum()) and padded["stored_positions"] == 640
    assert ragged["bytes_per_token"] == padded["bytes_per_token"] == 4 * 8 * 4
    assert padded["bytes_vs_tokens"] == pytest.approx(padded["bytes"] / (int(lengths.sum()) * 128))
    per_position = 4 * 8 * 4 + 8 + 1  # the states, the token id and the loss mask
    index = 4 * (2 * 10 + 1) * 8  # row_offsets and lengths, int64, per shard of 10 rows
    assert 0 < ragged["bytes"] - ragged["stored_positions"] * per_position - index < 4 * 1024  # the headers
    assert padded["bytes_vs_tokens"] > 1.9 and ragged["bytes_vs_tokens"] < 1.26  # 8-wide states: the ids weigh


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


def test_a_shard_takes_as_many_rows_as_its_byte_budget_holds_and_reads_back_unchanged(tmp_path):
    """Rows wait padded (every row the same bytes); a shard is flushed once the budget's rows are in, so what waits
    never passes it; rows_per_shard still caps a shard where the budget would allow more; a budget under one row
    makes one-row shards. The reader sees the same rows whatever the shards hold."""
    rows = random_rows(23, 12, 8, seed=5, ragged=True)
    row_bytes = sum(tensor[0].numel() * tensor.element_size() for tensor in rows.values())
    cases = {"budget": (100, int(3.5 * row_bytes), [3] * 7 + [2]), "rows": (4, 10 * row_bytes, [4] * 5 + [3]),
             "under_one_row": (100, row_bytes // 2, [1] * 23)}
    for name, (rows_per_shard, budget, sizes) in cases.items():
        out = tmp_path / name
        out.mkdir()
        writer = ShardWriter(out, rows_per_shard, "all", "ragged", shard_bytes=budget)
        waited = []
        for start in range(0, 23, 5):
            writer.add({key: tensor[start:start + 5] for key, tensor in rows.items()})
            waited.append(writer.pending_rows())
        metrics = writer.close().metrics()
        assert max(waited) * row_bytes <= max(budget, row_bytes), name
        assert [rows_of(path) for path in sorted(out.glob("features-*.safetensors"))] == sizes, name
        write_json_atomic(out / "manifest.json", {"stage": "features", "complete": True, "aux_layer_ids": [1, 2, 3],
                                                  "max_length": 12, "last_hidden": "all", "layout": "ragged",
                                                  "metrics": metrics})
        taken = open_features(out, [1, 2, 3], 12).take(torch.arange(23))
        for key, tensor in as_read(rows, "ragged", "all").items():
            assert torch.equal(taken[key], tensor), (name, key)


def rows_of(shard: Path) -> int:
    return read_header(shard)["lengths"].shape[0]


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_bfloat16_states_cost_half_the_bytes_per_token_and_read_back_as_stored(tmp_path, layout):
    rows = random_rows(10, 12, 8, seed=6, ragged=True)
    half = {**rows, **{name: rows[name].to(torch.bfloat16) for name in ("aux_hidden", "last_hidden")}}
    full = write_features(tmp_path / "fp32", rows, 4, "all", layout=layout)
    bf16 = write_features(tmp_path / "bf16", half, 4, "all", layout=layout)
    assert (full["bytes_per_token"], bf16["bytes_per_token"]) == (4 * 8 * 4, 4 * 8 * 2)
    taken = open_features(tmp_path / "bf16", [1, 2, 3], 12).take(torch.arange(10))
    for name, tensor in as_read(half, layout, "all").items():
        assert taken[name].dtype == tensor.dtype and torch.equal(taken[name], tensor), name


def test_opening_checks_the_manifest_and_the_shards(tmp_path):
    rows = random_rows(4, 12, 8, seed=2)
    write_features(tmp_path / "f", rows, 4, "loss_masked")
    with pytest.raises(RegraftError, match=r"cached for aux layers \[1, 2, 3\] and max_length 12"):
        open_features(tmp_path / "f", [0, 1, 2], 12)
    with pytest.raises(RegraftError, match="not a complete features stage output"):
        open_features(tmp_path, [1, 2, 3], 12)
    write_shard(shard_path(tmp_path / "f", 0), rows)  # a last_hidden=all shard where the manifest says loss_masked
    with pytest.raises(RegraftError, match="a layout=ragged last_hidden=loss_masked shard holds"):
        open_features(tmp_path / "f", [1, 2, 3], 12)


def test_the_stage_stores_the_states_in_the_dtype_the_target_ran_in(trained_target, chats, tmp_path):
    hidden = json.loads((trained_target / "config.json").read_text())["hidden_size"]
    common = [f"target={trained_target}", f"data={chats}", "max_length=48"]
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        result = features.run(compose_stage("features", common + [f"out={tmp_path / dtype}", f"dtype={dtype}"]))
        assert result.metrics["bytes_per_token"] == 4 * hidden * itemsize, dtype
    cfg = compose_stage("features", common + [f"out={tmp_path / 'auto'}", "dtype=auto"])
    with pytest.raises(RegraftError, match=r"^dtype=auto: is not a dtype .* \(fix: set dtype= to one of float32, "):
        check_config(cfg, FeaturesConfig, "")


STORAGES = [(layout, mode) for layout in Layout for mode in LastHidden]  # ragged/all first: the defaults


def test_a_finetune_on_ragged_or_loss_masked_features_matches_one_on_padded_rows(trained_target, chats,
                                                                                  training_map, tmp_path):
    """Same step-0 numbers for every loss rule, the same trained weights, bit for bit, from every layout and
    last_hidden; ragged files within 5% of the real tokens' states, padded ones not; loss_masked ones smaller by the
    final states of the positions no loss reads."""
    stored = {}
    for layout, mode in STORAGES:
        out = tmp_path / f"{layout.value}-{mode.value}"
        result = features.run(compose_stage("features", [f"target={trained_target}", f"data={chats}", f"out={out}",
                                                         "max_length=48", "rows_per_shard=16",
                                                         f"last_hidden={mode.value}", f"layout={layout.value}"]))
        stored[layout, mode] = result.metrics
        assert (read_manifest(out)["layout"], read_manifest(out)["last_hidden"]) == (layout.value, mode.value)
    hidden = json.loads((trained_target / "config.json").read_text())["hidden_size"]
    for layout in Layout:
        full, masked = stored[layout, LastHidden.all], stored[layout, LastHidden.loss_masked]
        assert full["bytes_per_token"] == 4 * hidden * 4  # fp32 on CPU
        skipped = (1 - masked["final_states_stored"]) * full["stored_positions"]  # positions without a final state
        assert full["bytes"] - masked["bytes"] == pytest.approx(skipped * hidden * 4, rel=0.02)
        assert masked["bytes_per_token"] == (3 + masked["final_states_stored"]) * hidden * 4
    padded = stored[Layout.padded, LastHidden.all]
    assert padded["stored_positions"] == padded["rows"] * 48
    assert stored[Layout.ragged, LastHidden.all]["bytes_vs_tokens"] <= 1.05  # these chats: 1.04 (tokens + 1 a row)
    assert padded["bytes_vs_tokens"] > 1.15  # rows near max_length: 1.16

    drafter = Eagle3Drafter.initialised(drafter_config_for(trained_target, 64), load_vocab_map(training_map), seed=0)
    layers = read_manifest(tmp_path / "padded-all")["aux_layer_ids"]
    head = TargetHead(trained_target)
    sources = {storage: open_features(tmp_path / f"{storage[0].value}-{storage[1].value}", layers, 48)
               for storage in STORAGES}
    with torch.no_grad():
        for rule in LossMask:
            batches = [next(micro_batches(split(sources[storage], 0.2, 0)[0], 8, 0, 0, 0, 1)) for storage in STORAGES]
            reference, *others = (run_ttt(drafter, head, batch, 3, rule).metrics() for batch in batches)
            assert all(metrics == reference for metrics in others) and reference["full_acc_0"] > 0, rule

    common = [f"target={trained_target}", f"vocab_map={training_map}", "init=scratch", "ttt_steps=3",
              "micro_batch_size=4", "max_length=48", "lr=3e-3", "val_fraction=0.2", "max_steps=4"]
    runs = {storage: finetune.run(compose_stage("finetune", common + [
        f"features={tmp_path / f'{storage[0].value}-{storage[1].value}'}", f"out={tmp_path / 'ft' / str(index)}"]))
        for index, storage in enumerate(STORAGES)}
    reference = runs[Layout.padded, LastHidden.all].metrics
    assert {"preflight_loss_0", "preflight_full_acc_0", "val_loss"} <= set(reference)
    assert all(run.metrics == reference for run in runs.values())  # preflight step-0 and val numbers
    weights = [Eagle3Drafter.from_checkpoint(tmp_path / "ft" / str(index) / "drafter").state_dict()
               for index in range(len(STORAGES))]
    for name, tensor in weights[0].items():
        assert all(torch.equal(tensor, other[name]) for other in weights[1:]), name


# ---------------------------------------------------------------- memory

RSS_LENGTH, RSS_BATCH = 128, 128  # tokens per row, rows per micro-batch
# Imports torch, DeepSpeed and the stage once (most of a fine-tune's start on 2 busy cores), then forks one child
# per fine-tune, as pipelines/launch/warm/server.py does (no torch op runs before a fork); prints each child's peak RSS (wait4).
PEAK_RSS_RUNNER = """
import json, os, sys, traceback
from stages import finetune
from stages.common.contract.stage import check_config, compose_stage
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
                      aux_convention=config.aux_convention, max_length=RSS_LENGTH, last_hidden="all", layout="ragged")
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
