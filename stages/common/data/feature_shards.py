"""The features stage's cache as files: `features-NNNNN.safetensors` shards, written and streamed back checked.

Two layouts (`Layout`, named in the manifest):
- `ragged` (the default): each conversation's stored positions only, rows concatenated: `input_ids`, `loss_mask`
  [P] and `aux_hidden` [P, 3H], row i at `row_offsets[i]:[i+1]` ([n+1]) and its real token count in `lengths` [n].
  A row stores its real tokens and, when shorter than `max_length`, the one position after them: a TTT step reads
  the token id and the target's final state there (the `specforge` rule's last prediction of an answer that ends
  the row), so a fine-tune reads exactly what it reads from padded rows. Rows are padded when they are read.
- `padded`: `input_ids`, `attention_mask`, `loss_mask` [n, L] and `aux_hidden` [n, L, 3H], rows padded to
  `max_length` (what regraft wrote before; 1.9x the tokens' bytes on the default world).
The final hidden state (after the final norm, so logits = lm_head(last_hidden)) is stored in one of two forms
(`LastHidden`, named in the manifest):
- `all`: `last_hidden` at every stored position ([P, H] ragged, [n, L, H] padded);
- `loss_masked`: only at the positions some TTT loss can read (`final_state_positions`), packed row after row as
  `last_hidden_packed` [K, H], row i's states at `last_hidden_offsets[i]:[i+1]` ([n+1]); read back as [n, L, H]
  with zeros elsewhere, which no loss or accuracy reads.

Write with `ShardWriter` (a shard is `rows_per_shard` rows, or fewer within a byte budget); what the shards cost
comes back as `StoredFeatures` (`bytes_per_token`: the aux and final states per stored position at the stored dtype,
4 * H * itemsize with `all`; `bytes_vs_tokens`: the files over real tokens x bytes_per_token). Read with
`open_features`: a `FeatureRows` row source that reads only the rows a `take` asks for (positional reads into fresh
buffers, each shard opened once per take and closed after it; no mmap, whose touched pages would count in the
resident set), so a fine-tune holds one micro-batch of features, never the set. `TensorRows` is the same interface
over rows in memory (online: tokenized chats), `RowSubset` a view of some rows (the train/val split). The manifest
names the aux layers (output-of-layer convention), `max_length`, `layout` and `last_hidden` the rows were cached
with; opening checks them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from stages.common.contract.artifacts import read_manifest
from stages.common.contract.errors import RegraftError
from stages.common.data.feature_layout import LastHidden, Layout
from stages.common.drafter.tensor_io import (StoredTensor, byte_view, numel, pread_exact, read_header, spec_of,
                                     write_safetensors)

SHARD_PATTERN = "features-*.safetensors"
ROW_TENSORS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden")  # one row per conversation in every shard
RAGGED_TENSORS = ("input_ids", "loss_mask", "aux_hidden")  # one entry per stored position
PACKED, OFFSETS = "last_hidden_packed", "last_hidden_offsets"
ROW_OFFSETS, LENGTHS = "row_offsets", "lengths"


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"features-{index:05d}.safetensors"


def write_shard(path: Path, rows: dict[str, torch.Tensor]) -> None:
    write_safetensors(path, [spec_of(name, tensor.contiguous()) for name, tensor in rows.items()])


# ---------------------------------------------------------------- which final states a loss can read


def final_state_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[n, L] bool: positions j with m[j] or m[j-1], a superset of the final states any TTT loss reads.

    Step k's prediction at t (of token p = t+2+k) reads the target's logits at j = p-1 = t+1+k and only where its
    gate is set (stages/common/drafter/ttt.py): `drafted` needs m[t+1..p], so m[j]; `speculators` m[t+1+k] = m[j];
    `specforge` m[t+k] = m[j-1]. Elsewhere the loss multiplies the target's distribution by a zero gate and the
    accuracy counts are and-ed with it, so a zero state there changes nothing, for every rule and any `ttt_steps`.
    """
    mask = loss_mask.to(torch.bool)
    after = torch.zeros_like(mask)
    after[:, 1:] = mask[:, :-1]
    return mask | after


def pack_final_states(rows: dict[str, torch.Tensor], last_hidden: LastHidden) -> dict[str, torch.Tensor]:
    """A padded shard's tensors: rows as they are (`all`), or with `last_hidden` packed where a loss can read it."""
    if last_hidden is LastHidden.all:
        return rows
    return {**{name: tensor for name, tensor in rows.items() if name != "last_hidden"},
            **packed_final_states(rows["last_hidden"], final_state_positions(rows["loss_mask"]))}


def packed_final_states(last_hidden: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    offsets = torch.zeros(keep.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = keep.sum(1).cumsum(0)
    return {PACKED: last_hidden[keep], OFFSETS: offsets}


def stored_positions(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] real tokens, [n, L] bool: the positions a ragged shard stores: the real tokens and the one after)."""
    lengths = attention_mask.sum(1).to(torch.int64)
    stored = (lengths + 1).clamp(max=attention_mask.shape[1])
    return lengths, torch.arange(attention_mask.shape[1])[None] < stored[:, None]


def ragged_rows(rows: dict[str, torch.Tensor], last_hidden: LastHidden) -> dict[str, torch.Tensor]:
    """A ragged shard's tensors from padded rows (right-padded: real tokens first)."""
    lengths, stored = stored_positions(rows["attention_mask"])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = stored.sum(1).cumsum(0)
    shard = {name: rows[name][stored] for name in RAGGED_TENSORS}
    if last_hidden is LastHidden.all:
        shard["last_hidden"] = rows["last_hidden"][stored]
    else:
        shard.update(packed_final_states(rows["last_hidden"], final_state_positions(rows["loss_mask"]) & stored))
    return {**shard, ROW_OFFSETS: offsets, LENGTHS: lengths}


# ---------------------------------------------------------------- writing


@dataclass
class StoredFeatures:
    """What the shards written so far cost."""

    shards: int = 0
    tokens: int = 0  # real tokens
    positions: int = 0  # stored positions: rows x max_length (padded), real tokens and one after each (ragged)
    state_bytes: int = 0  # aux and final hidden states as written
    final_states: int = 0  # positions whose final state is stored
    bytes: int = 0  # the shard files, token ids, masks and headers included

    def metrics(self) -> dict[str, float | int]:
        per_position = self.state_bytes / max(self.positions, 1)
        return {"shards": self.shards, "bytes": self.bytes, "stored_positions": self.positions,
                "bytes_per_token": per_position, "bytes_vs_tokens": self.bytes / max(self.tokens * per_position, 1),
                "final_states_stored": self.final_states / max(self.positions, 1)}


def state_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ShardWriter:
    """Rows in (padded, as the target ran them), in batches of any size; shards out in `layout`, each of
    `rows_per_shard` rows, or of fewer where that many would hold more than `shard_bytes` here (rows as they are
    held, padded: a row's bytes are the same for every row), at least one; the last may hold fewer. So what waits
    to be written never passes the budget (a Kimi-K2.5 row of 2,048 tokens is 117 MB in bf16: 512 of them would be
    60 GB), and a shard's file holds at most that (ragged shards less)."""

    def __init__(self, folder: Path, rows_per_shard: int, last_hidden: LastHidden | str = LastHidden.all,
                 layout: Layout | str = Layout.ragged, shard_bytes: int | None = None):
        self.folder, self.rows_per_shard, self.shard_bytes = Path(folder), rows_per_shard, shard_bytes
        self.last_hidden, self.layout = LastHidden(last_hidden), Layout(layout)
        self.pending: list[dict[str, torch.Tensor]] = []
        self.stored = StoredFeatures()

    def pending_rows(self) -> int:
        return sum(rows["input_ids"].shape[0] for rows in self.pending)

    def shard_rows(self) -> int:
        """Rows a shard takes: `rows_per_shard`, or as many as `shard_bytes` holds (at least one)."""
        if not self.shard_bytes or not self.pending:
            return self.rows_per_shard
        row_bytes = sum(state_bytes(tensor[0]) for tensor in self.pending[0].values())
        return max(1, min(self.rows_per_shard, self.shard_bytes // row_bytes))

    def add(self, rows: dict[str, torch.Tensor]) -> None:
        self.pending.append(rows)
        while self.pending_rows() >= self.shard_rows():
            self.flush(self.shard_rows())

    def close(self) -> StoredFeatures:
        if self.pending_rows():
            self.flush(self.pending_rows())
        return self.stored

    def take(self, count: int) -> dict[str, torch.Tensor]:
        """The first `count` pending rows, joined; only the batches they come from are copied."""
        taken, left = [], count
        while left:
            first = self.pending[0]
            size = first["input_ids"].shape[0]
            if size <= left:
                taken.append(self.pending.pop(0))
            else:
                taken.append({name: tensor[:left] for name, tensor in first.items()})
                self.pending[0] = {name: tensor[left:] for name, tensor in first.items()}
            left -= min(size, left)
        return {name: torch.cat([rows[name] for rows in taken]) for name in taken[0]}

    def flush(self, count: int) -> None:
        rows = self.take(count)
        shard = ragged_rows(rows, self.last_hidden) if self.layout is Layout.ragged \
            else pack_final_states(rows, self.last_hidden)
        path = shard_path(self.folder, self.stored.shards)
        write_shard(path, shard)
        final = shard.get("last_hidden", shard.get(PACKED))
        self.stored.shards += 1
        self.stored.tokens += int(rows["attention_mask"].sum())
        self.stored.positions += shard["input_ids"].numel()
        self.stored.state_bytes += state_bytes(shard["aux_hidden"]) + state_bytes(final)
        self.stored.final_states += final.numel() // final.shape[-1]
        self.stored.bytes += path.stat().st_size


# ---------------------------------------------------------------- reading: row sources


class Rows(Protocol):
    """What a fine-tune reads its data through: a row count, and the rows at some indices as [len(indices), ...]."""

    def __len__(self) -> int: ...

    def take(self, indices: torch.Tensor) -> dict[str, torch.Tensor]: ...


class TensorRows:
    """Rows held in memory (online: tokenized chats, a few bytes per token)."""

    def __init__(self, data: dict[str, torch.Tensor]):
        self.data = data

    def __len__(self) -> int:
        return self.data["input_ids"].shape[0]

    def take(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: tensor[indices] for name, tensor in self.data.items()}


class RowSubset:
    """The rows of `source` at `indices`, in that order (a split of a data set, without a copy of it)."""

    def __init__(self, source: Rows, indices: torch.Tensor):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return self.indices.numel()

    def take(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.source.take(self.indices[indices])


def as_rows(data: Rows | dict[str, torch.Tensor]) -> Rows:
    return TensorRows(data) if isinstance(data, dict) else data


@dataclass(frozen=True)
class Column:
    """One tensor as every shard stores it: dtype and the shape of one row (a packed state is one row of H)."""

    name: str
    dtype: torch.dtype
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return numel(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()




class FeatureRows:
    """The rows of a features stage output, read from its shards a `take` at a time (see the module docstring).

    Per shard it keeps only its path, row count and each tensor's byte offset, so what it holds grows by a few
    hundred bytes a shard; a take opens each shard it touches once, reads its rows into fresh buffers and closes it.
    """

    def __init__(self, paths: list[str], sizes: list[int], offsets: torch.Tensor, columns: list[Column],
                 last_hidden: LastHidden, layout: Layout = Layout.padded, max_length: int | None = None):
        self.paths, self.offsets, self.last_hidden = paths, offsets, last_hidden  # offsets: [S, len(columns)]
        self.layout, self.max_length = layout, max_length
        self.columns = {column.name: index for index, column in enumerate(columns)}
        self.stored_columns = columns
        self.starts = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0)  # shard s: rows starts[s]:starts[s+1]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def column(self, name: str) -> Column:
        return self.stored_columns[self.columns[name]]

    def row_shape(self, name: str) -> tuple[int, ...]:
        """The shape of one padded row of a tensor as a take returns it."""
        shape = self.column(name).row_shape
        return (self.max_length, *shape) if self.layout is Layout.ragged else shape

    def take(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows at `indices`, in that order, padded to max_length; each shard touched is opened once."""
        indices = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        shard_of = torch.searchsorted(self.starts, indices, right=True) - 1
        local = indices - self.starts[shard_of]
        out = self.empty_rows(indices.numel())
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for position, (shard, row) in enumerate(zip(shard_of.tolist(), local.tolist())):
            by_shard.setdefault(shard, []).append((position, row))
        for shard, picks in by_shard.items():
            fd = os.open(self.paths[shard], os.O_RDONLY)
            try:
                for position, row in picks:
                    target = {name: tensor[position] for name, tensor in out.items()}
                    if self.layout is Layout.ragged:
                        self.read_ragged_row(fd, shard, row, target)
                    else:
                        self.read_padded_row(fd, shard, row, target)
            finally:
                os.close(fd)
        return out

    def empty_rows(self, count: int) -> dict[str, torch.Tensor]:
        """Zeroed buffers for `count` rows: a ragged row fills its stored positions, zeros stand for the rest."""
        final = self.column("last_hidden" if self.last_hidden is LastHidden.all else PACKED)
        out = {name: torch.zeros((count, *self.row_shape(name)), dtype=self.column(name).dtype)
               for name in RAGGED_TENSORS}
        out["attention_mask"] = torch.zeros(out["loss_mask"].shape, dtype=torch.bool) \
            if self.layout is Layout.ragged else torch.empty((count, *self.row_shape("attention_mask")),
                                                             dtype=self.column("attention_mask").dtype)
        out["last_hidden"] = torch.zeros((*out["loss_mask"].shape, final.row_shape[-1]), dtype=final.dtype)
        return {name: out[name] for name in (*ROW_TENSORS, "last_hidden")}

    def read_padded_row(self, fd: int, shard: int, row: int, out: dict[str, torch.Tensor]) -> None:
        for name in ROW_TENSORS + (("last_hidden",) if self.last_hidden is LastHidden.all else ()):
            self.read(fd, shard, name, row, out[name])
        if self.last_hidden is LastHidden.loss_masked:
            self.unpack(fd, shard, row, out["loss_mask"], out["last_hidden"])

    def read_ragged_row(self, fd: int, shard: int, row: int, out: dict[str, torch.Tensor]) -> None:
        """A row's stored positions into the first entries of its padded buffers; the pad token id (stored at the
        position after the real tokens) fills the rest of `input_ids`, as a padded row holds it."""
        bounds, length = torch.empty(2, dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        self.read(fd, shard, ROW_OFFSETS, row, bounds)
        self.read(fd, shard, LENGTHS, row, length)
        first, stored, real = int(bounds[0]), int(bounds[1] - bounds[0]), int(length[0])
        if not real <= stored <= self.max_length:
            raise RegraftError(self.paths[shard], f"row {row} stores {stored} positions of {real} tokens",
                               "rebuild the features (python -m stages.features)")
        names = RAGGED_TENSORS + (("last_hidden",) if self.last_hidden is LastHidden.all else ())
        for name in names:
            self.read(fd, shard, name, first, out[name][:stored])
        out["attention_mask"][:real] = True
        if stored < self.max_length:
            out["input_ids"][stored:] = out["input_ids"][stored - 1]
        if self.last_hidden is LastHidden.loss_masked:
            self.unpack(fd, shard, row, out["loss_mask"], out["last_hidden"])

    def read(self, fd: int, shard: int, name: str, first: int, out: torch.Tensor) -> None:
        """Entries first.. of one tensor of a shard (rows, or positions of a ragged one), as many as `out` holds."""
        offset = int(self.offsets[shard, self.columns[name]]) + first * self.column(name).row_bytes
        pread_exact(fd, byte_view(out), offset, self.paths[shard], "the shard is truncated: rebuild the features")

    def unpack(self, fd: int, shard: int, row: int, loss_mask: torch.Tensor, out: torch.Tensor) -> None:
        """A row's packed final states into `out` [L, H] (zeros) where `final_state_positions` kept them."""
        bounds = torch.empty(2, dtype=torch.int64)
        self.read(fd, shard, OFFSETS, row, bounds)
        keep = final_state_positions(loss_mask[None])[0]
        if int(keep.sum()) != int(bounds[1] - bounds[0]):
            raise RegraftError(self.paths[shard], "packed final states do not match the loss mask",
                               "rebuild the features (python -m stages.features)")
        states = torch.empty((int(bounds[1] - bounds[0]), out.shape[-1]), dtype=out.dtype)
        self.read(fd, shard, PACKED, int(bounds[0]), states)
        out[keep] = states


def stored_names(layout: Layout, last_hidden: LastHidden) -> list[str]:
    """The tensors a shard of this layout and `last_hidden` holds."""
    names = list(RAGGED_TENSORS) + [ROW_OFFSETS, LENGTHS] if layout is Layout.ragged else list(ROW_TENSORS)
    return names + (["last_hidden"] if last_hidden is LastHidden.all else [PACKED, OFFSETS])


def shard_columns(header: dict[str, StoredTensor], layout: Layout, last_hidden: LastHidden) -> list[Column]:
    """The columns a shard holds, in the layout the manifest names (the packed ones by their row shapes)."""
    names = stored_names(layout, last_hidden)
    shard = next(iter(header.values())).path if header else "?"
    if set(header) != set(names):
        raise RegraftError(shard, f"holds {sorted(header)}, a layout={layout.value} last_hidden={last_hidden.value} "
                           f"shard holds {sorted(names)}", "rebuild the features (python -m stages.features)")
    return [Column(name, header[name].dtype, header[name].shape[1:]) for name in names]


def rows_in(header: dict[str, StoredTensor], layout: Layout) -> int:
    return header[LENGTHS].shape[0] if layout is Layout.ragged else header["input_ids"].shape[0]


def open_features(path: str | Path, aux_layer_ids: list[int], max_length: int) -> FeatureRows:
    """The cached rows as a row source, checked against what the training expects (aux layers, max_length) and
    against each other (every shard the same tensors, dtypes and row shapes); nothing but headers is read."""
    manifest = read_manifest(path)
    if manifest is None or manifest.get("stage") != "features":
        raise RegraftError(path, "not a complete features stage output", "run python -m stages.features first")
    if manifest["aux_layer_ids"] != list(aux_layer_ids) or manifest["max_length"] != max_length:
        raise RegraftError(path, f"cached for aux layers {manifest['aux_layer_ids']} and max_length "
                           f"{manifest['max_length']}, training wants {list(aux_layer_ids)} and {max_length}",
                           "rebuild the features for this drafter")
    last_hidden = LastHidden(manifest.get("last_hidden", LastHidden.all.value))
    layout = Layout(manifest.get("layout", Layout.padded.value))  # outputs written before ragged shards existed
    paths, sizes, offsets, columns_seen = [], [], [], None
    folders = [Path(part) for part in manifest.get("part_outputs", [])] or [Path(path)]  # a join streams its parts
    for shard in (shard for folder in folders for shard in sorted(folder.glob(SHARD_PATTERN))):
        header = read_header(shard)
        columns = shard_columns(header, layout, last_hidden)
        columns_seen = columns_seen or columns
        if columns != columns_seen:
            raise RegraftError(shard, "tensors of other dtypes or row shapes than the first shard's",
                               "rebuild the features (python -m stages.features)")
        paths.append(str(shard))
        sizes.append(rows_in(header, layout))
        offsets.append([header[column.name].offset for column in columns])
    if columns_seen is None:
        raise RegraftError(path, "holds no feature shards", "rebuild the features (python -m stages.features)")
    return FeatureRows(paths, sizes, torch.tensor(offsets, dtype=torch.int64), columns_seen, last_hidden, layout,
                       max_length)


def load_features(path: str | Path, aux_layer_ids: list[int], max_length: int) -> dict[str, torch.Tensor]:
    """Every cached row in memory, checked (benchmarks and small sets; the finetune streams with `open_features`)."""
    rows = open_features(path, aux_layer_ids, max_length)
    return rows.take(torch.arange(len(rows)))
