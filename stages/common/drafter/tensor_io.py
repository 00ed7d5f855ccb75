"""Lazy safetensors reading and streaming writing, with memory bounded by what is asked for.

The format is an 8-byte little-endian header length, a JSON header (dtype, shape, byte offsets per tensor) and
the raw bytes. Reading parses the header and `pread`s exactly the requested bytes into buffers regraft owns:
`safetensors.safe_open` memory-maps the file and hands out views, which keeps every touched page of a multi-GB
checkpoint in the process's resident set (6.8x the lm_head in bench/remap.py). Writing streams tensors one chunk
at a time, and a tensor carried over unchanged is copied file-to-file by the kernel (`copy_file_range`).
Files written here read back with `safetensors` itself; the tests check that.
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

from stages.common.contract.errors import RegraftError

ROWS_PER_CHUNK = 2048
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


@dataclass(frozen=True)
class FileRange:
    """Bytes of one tensor inside a file: copied as they are when the tensor is carried over unchanged."""

    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its metadata, and either a function yielding its row-major chunks or a FileRange.

    The writer consumes each chunk before asking for the next, so a producer may reuse one buffer.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor]] | None = None
    file_range: FileRange | None = None

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, tensor.dtype, tuple(tensor.shape), lambda: [tensor])


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _copy_range(source: FileRange, out) -> None:
    out.flush()
    with open(source.path, "rb") as src:
        offset, left = source.offset, source.nbytes
        while left:
            try:
                done = os.copy_file_range(src.fileno(), out.fileno(), left, offset)
            except OSError:  # filesystems without copy_file_range: plain reads
                done = os.write(out.fileno(), os.pread(src.fileno(), min(left, 64 << 20), offset))
            if done == 0:
                raise RegraftError(source.path, "ended before the tensor's last byte", "the file is truncated")
            offset, left = offset + done, left - done


def write_safetensors(path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> None:
    """Write specs to `path` (via a temp name and rename), streaming each tensor."""
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
                _write_one(spec, out)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_one(spec: TensorSpec, out) -> None:
    if spec.file_range is not None:
        if spec.file_range.nbytes != spec.nbytes:
            raise ValueError(f"tensor {spec.name}: file range of {spec.file_range.nbytes} bytes, expected {spec.nbytes}")
        _copy_range(spec.file_range, out)
        return
    written = 0
    for chunk in spec.chunks():
        if chunk.dtype != spec.dtype:
            raise ValueError(f"tensor {spec.name}: chunk dtype {chunk.dtype} != {spec.dtype}")
        written += out.write(byte_view(chunk.contiguous()))
    if written != spec.nbytes:
        raise ValueError(f"tensor {spec.name}: wrote {written} bytes, expected {spec.nbytes}")


@dataclass(frozen=True)
class StoredTensor:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its header alone; malformed files fail with their name."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise ValueError(f"header length {header_len} exceeds the file")
            header = json.loads(handle.read(header_len))
        start = 8 + header_len
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = DTYPES_BY_NAME[info["dtype"]], tuple(info["shape"])
            begin, end = info["data_offsets"]
            expected = numel(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != expected or start + end > size:
                raise ValueError(f"tensor {name} has bad offsets")
            tensors[name] = StoredTensor(path, dtype, shape, start + begin, end - begin)
        return tensors
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise RegraftError(path, f"not a readable safetensors file ({exc})", "re-save the file") from exc


class SafetensorsFiles:
    """Lazy access to the tensors of one `.safetensors` file or an indexed set of shards."""

    def __init__(self, tensors: dict[str, StoredTensor]):
        self.tensors = tensors

    @classmethod
    def open_model_dir(cls, model_dir: str | Path) -> "SafetensorsFiles":
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return cls({name: t for shard in shards for name, t in read_header(model_dir / shard).items()})
        if (model_dir / "model.safetensors").exists():
            return cls.open_file(model_dir / "model.safetensors")
        raise RegraftError(model_dir, "no model.safetensors or model.safetensors.index.json",
                           "point at a folder saved with safetensors (save_pretrained writes one)")

    @classmethod
    def open_file(cls, path: str | Path) -> "SafetensorsFiles":
        return cls(read_header(Path(path)))

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def file_range(self, name: str) -> FileRange:
        stored = self.tensors[name]
        return FileRange(stored.path, stored.offset, stored.nbytes)

    def get(self, name: str) -> torch.Tensor:
        stored = self.tensors[name]
        out = torch.empty(stored.shape, dtype=stored.dtype)
        _pread_into(stored.path, [(stored.offset, byte_view(out))])
        return out

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        stored = self.tensors[name]
        out = torch.empty((stop - start, *stored.shape[1:]), dtype=stored.dtype)
        _pread_into(stored.path, [(stored.offset + start * stored.row_bytes, byte_view(out))])
        return out

    def gather_rows(self, name: str, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `row_ids` of a 2-D tensor, one read per run of consecutive ids; into `out` when given."""
        stored = self.tensors[name]
        row_ids = row_ids.to(torch.int64)
        order = None
        if row_ids.numel() > 1 and not bool((row_ids[1:] >= row_ids[:-1]).all()):
            order = torch.argsort(row_ids)
            row_ids = row_ids[order]
        target = out if out is not None and order is None else torch.empty(
            (row_ids.numel(), *stored.shape[1:]), dtype=stored.dtype)
        reads, position = [], 0
        for run in consecutive_runs(row_ids):
            count = run.numel()
            reads.append((stored.offset + int(run[0]) * stored.row_bytes, byte_view(target[position:position + count])))
            position += count
        _pread_into(stored.path, reads)
        if order is None:
            return target
        result = out if out is not None else torch.empty_like(target)
        result[order] = target
        return result

    def iter_row_chunks(self, name: str, rows_per_chunk: int = ROWS_PER_CHUNK) -> Iterator[torch.Tensor]:
        shape = self.shape(name)
        if len(shape) < 2:
            yield self.get(name)
            return
        for start in range(0, shape[0], rows_per_chunk):
            yield self.rows(name, start, min(start + rows_per_chunk, shape[0]))


def _pread_into(path: Path, reads: list[tuple[int, memoryview]]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if len(reads) > 1 and hasattr(os, "posix_fadvise"):
            # Announce every range first so a cold disk serves scattered rows concurrently, not one seek at a time.
            for offset, buffer in reads:
                os.posix_fadvise(fd, offset, buffer.nbytes, os.POSIX_FADV_WILLNEED)
        for offset, buffer in reads:
            pread_exact(fd, buffer, offset, path, "the file is truncated")
    finally:
        os.close(fd)


def pread_exact(fd: int, buffer: memoryview, offset: int, path: str | Path, fix: str) -> None:
    """Fill `buffer` from `offset` of an open file (short reads retried); a file that ends first is an error."""
    done = 0
    while done < buffer.nbytes:
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise RegraftError(path, "ended before the last byte asked for", fix)
        done += got


def consecutive_runs(sorted_ids: torch.Tensor) -> list[torch.Tensor]:
    """Split a sorted 1-D id tensor into runs of consecutive values (duplicates start a new run)."""
    if sorted_ids.numel() == 0:
        return []
    breaks = torch.nonzero(sorted_ids[1:] - sorted_ids[:-1] != 1).flatten() + 1
    return list(torch.tensor_split(sorted_ids, breaks))
