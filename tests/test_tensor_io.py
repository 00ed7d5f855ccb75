"""Streaming safetensors writing and positional reading agree with the safetensors library, byte for byte."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.common.contract.errors import RegraftError
from stages.common.drafter.tensor_io import SafetensorsFiles, TensorSpec, consecutive_runs, spec_of, write_safetensors


@pytest.fixture
def library_file(tmp_path):
    tensors = {"w": torch.randn(37, 5).to(torch.bfloat16), "ids": torch.arange(7), "flags": torch.rand(9) > 0.5,
               "h": torch.randn(3, 4, 2)}
    save_file(tensors, tmp_path / "lib.safetensors")
    return tmp_path / "lib.safetensors", tensors


def test_reader_matches_library(library_file):
    path, tensors = library_file
    files = SafetensorsFiles.open_file(path)
    for name, tensor in tensors.items():
        assert files.dtype(name) == tensor.dtype and files.shape(name) == tuple(tensor.shape)
        assert torch.equal(files.get(name), tensor)
    w = tensors["w"]
    assert torch.equal(files.rows("w", 3, 11), w[3:11])
    for ids in ([0, 1, 2, 10, 11, 36], [30, 2, 2, 17, 3], [], [36]):
        assert torch.equal(files.gather_rows("w", torch.tensor(ids, dtype=torch.int64)), w[ids])
    out = torch.empty(4, 5, dtype=torch.bfloat16)
    assert files.gather_rows("w", torch.tensor([4, 5, 6, 20]), out) is out and torch.equal(out, w[[4, 5, 6, 20]])
    assert torch.equal(torch.cat(list(files.iter_row_chunks("w", 10))), w)


def test_writer_streams_chunks_and_file_ranges(library_file, tmp_path):
    path, tensors = library_file
    files = SafetensorsFiles.open_file(path)
    w = tensors["w"]
    buffer = torch.empty(8, 5, dtype=torch.bfloat16)

    def reused_buffer_chunks():
        for start in range(0, 37, 8):
            view = buffer[: min(8, 37 - start)]
            view.copy_(w[start:start + 8])
            yield view

    specs = [TensorSpec("w", torch.bfloat16, (37, 5), reused_buffer_chunks),
             TensorSpec("h", torch.float32, (3, 4, 2), file_range=files.file_range("h")),
             spec_of("flags", tensors["flags"])]
    write_safetensors(tmp_path / "out.safetensors", specs, metadata={"format": "pt"})
    back = load_file(tmp_path / "out.safetensors")
    assert torch.equal(back["w"], w) and torch.equal(back["h"], tensors["h"]) and torch.equal(back["flags"], tensors["flags"])


def test_short_chunks_are_refused_and_leave_no_file(tmp_path):
    spec = TensorSpec("w", torch.float32, (4, 2), lambda: [torch.zeros(3, 2)])
    with pytest.raises(ValueError, match="wrote 24 bytes, expected 32"):
        write_safetensors(tmp_path / "x.safetensors", [spec])
    assert list(tmp_path.iterdir()) == []


def test_truncated_file_is_named(library_file, tmp_path):
    path, _ = library_file
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 16])
    with pytest.raises(RegraftError, match="cut.safetensors: not a readable safetensors file"):
        SafetensorsFiles.open_file(tmp_path / "cut.safetensors")


def test_consecutive_runs():
    runs = consecutive_runs(torch.tensor([1, 2, 3, 7, 8, 8, 10]))
    assert [r.tolist() for r in runs] == [[1, 2, 3], [7, 8], [8], [10]]
