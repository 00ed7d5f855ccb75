"""Lazy safetensors reading and streaming writing.

Reading goes through `safetensors.safe_open`, one tensor (or one row range) at a time. Writing streams tensors
into the file one by one, so a multi-GB checkpoint is never held in memory at once: the header (names, dtypes,
shapes, offsets) is known up front, then each tensor's bytes are produced and written in turn.
"""
from __future__ import annotations

import json
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from stages.common.errors import RegraftError

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its metadata, and a function yielding its bytes in row-major chunks."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, tensor.dtype, tuple(tensor.shape), lambda: [tensor])


def _raw_bytes(chunk: torch.Tensor) -> memoryview:
    flat = chunk.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> None:
    """Write specs to `path` (via a temp name and rename), streaming each tensor's chunks."""
    path = Path(path)
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data section to 8 bytes
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(header_bytes)))
            out.write(header_bytes)
            for spec in specs:
                written = 0
                for chunk in spec.chunks():
                    if chunk.dtype != spec.dtype:
                        raise ValueError(f"tensor {spec.name}: chunk dtype {chunk.dtype} != {spec.dtype}")
                    data = _raw_bytes(chunk)
                    out.write(data)
                    written += data.nbytes
                if written != spec.nbytes:
                    raise ValueError(f"tensor {spec.name}: wrote {written} bytes, expected {spec.nbytes}")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class SafetensorsFiles:
    """Lazy access to the tensors of one `.safetensors` file or an indexed set of shards."""

    def __init__(self, files_by_name: dict[str, Path]):
        self.files_by_name = files_by_name
        self._handles: dict[Path, object] = {}

    @classmethod
    def open_model_dir(cls, model_dir: str | Path) -> "SafetensorsFiles":
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls({name: model_dir / shard for name, shard in weight_map.items()})
        if single.exists():
            return cls.open_file(single)
        raise RegraftError(model_dir, "no model.safetensors or model.safetensors.index.json",
                           "point at a folder saved with safetensors (save_pretrained writes one)")

    @classmethod
    def open_file(cls, path: str | Path) -> "SafetensorsFiles":
        path = Path(path)
        try:
            with safe_open(path, framework="pt") as handle:
                names = list(handle.keys())
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise RegraftError(path, f"not a readable safetensors file ({exc})", "re-save the file") from exc
        return cls({name: path for name in names})

    def _handle(self, name: str):
        if name not in self.files_by_name:
            raise KeyError(name)
        path = self.files_by_name[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self.files_by_name)

    def __contains__(self, name: str) -> bool:
        return name in self.files_by_name

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES_BY_NAME[self._handle(name).get_slice(name).get_dtype()]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._handle(name).get_slice(name)[start:stop]

    def gather_rows(self, name: str, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows `row_ids` (any order) of a 2-D tensor, reading each run of consecutive ids in one slice."""
        row_ids = row_ids.to(torch.int64)
        order = torch.argsort(row_ids)
        sorted_ids = row_ids[order]
        pieces = [self.rows(name, int(run[0]), int(run[-1]) + 1) for run in consecutive_runs(sorted_ids)]
        if not pieces:
            return torch.empty((0, *self.shape(name)[1:]), dtype=self.dtype(name))
        gathered = torch.cat(pieces)
        out = torch.empty_like(gathered)
        out[order] = gathered
        return out

    def iter_row_chunks(self, name: str, rows_per_chunk: int) -> Iterator[torch.Tensor]:
        shape = self.shape(name)
        if len(shape) < 2:
            yield self.get(name)
            return
        for start in range(0, shape[0], rows_per_chunk):
            yield self.rows(name, start, min(start + rows_per_chunk, shape[0]))


def consecutive_runs(sorted_ids: torch.Tensor) -> list[torch.Tensor]:
    """Split a sorted 1-D id tensor into runs of consecutive values (duplicates start a new run)."""
    if sorted_ids.numel() == 0:
        return []
    breaks = torch.nonzero(sorted_ids[1:] - sorted_ids[:-1] != 1).flatten() + 1
    return list(torch.tensor_split(sorted_ids, breaks))
