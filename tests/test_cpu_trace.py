"""bench/cpu_trace.py: a traced world build is the world itself, and two records are compared op by op."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from bench.cpu_trace import compare, load
from tests.test_world import TINY_WORLD_DIGESTS, cpu_vendor

ROOT = Path(__file__).resolve().parents[1]


def write_record(path: Path, sequence: list[list[str]], battery: dict[str, str], files: dict[str, str]) -> Path:
    record = {"machine": {"model": path.stem, "vendor": "x", "flags": ["avx2"]}, "digest": "d" * 64,
              "cpu_settings": {"cpu_capability": "AVX2", "mkl_cbwr": "COMPATIBLE", "threads": 1},
              "files": files, "sequence": sequence, "battery": battery}
    with gzip.open(path, "wt") as file:
        json.dump(record, file)
    return path


def test_compare_names_the_first_op_that_parts_and_the_battery_ops_that_differ(tmp_path):
    ops = [["aten.mm.default", "a1"], ["aten.add.Tensor", "a2"], ["aten._softmax.default", "a3"],
           ["aten.mm.default", "a4"]]
    battery = {'aten.mm.default[1]': "m", 'aten.mm.default[2]': "n", 'aten.exp.default[1]': "e",
               'aten.bad.default[1]': "error: RuntimeError"}
    first = write_record(tmp_path / "one.json.gz", ops, battery, {"tokenizer.json": "t", "w.safetensors": "w"})
    parted = [ops[0], ops[1], ["aten._softmax.default", "b3"], ["aten.mm.default", "b4"]]
    second = write_record(tmp_path / "two.json.gz", parted, {**battery, 'aten.exp.default[1]': "f",
                                                             'aten.bad.default[1]': "z"},
                          {"tokenizer.json": "t", "w.safetensors": "v"})
    table = compare(first, second)
    assert "world file tokenizer.json: same" in table and "world file w.safetensors: DIFFERS" in table
    assert "the first 2 ops agree; op 3 (aten._softmax.default) gives other bits" in table
    assert "battery: 3 calls run on both, 1 give other bits" in table and "aten.exp.default: 1 of 1 calls" in table
    assert "aten.mm.default:" not in table  # the same bits on both

    same = compare(first, first)
    assert "all 4 traced ops agree" in same and "battery: 3 calls run on both, 0 give other bits" in same


def test_a_traced_build_is_the_pinned_world(tmp_path):
    """The dispatch mode that hashes every op changes no bit: the traced world=tiny has this vendor's digest."""
    out = tmp_path / "trace.json.gz"
    subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_trace.py"), "record", "--out", str(out), "--ops",
                    "500"], check=True, capture_output=True, timeout=900)
    record = load(out)
    assert record["digest"] == TINY_WORLD_DIGESTS[cpu_vendor()]
    assert record["cpu_settings"]["in_effect"] and record["cpu_settings"]["threads"] == 1
    assert len(record["sequence"]) == 500 and record["sequence"][0][0].startswith("aten.")
    ran = [value for value in record["battery"].values() if not value.startswith("error")]
    assert len(ran) > 0.8 * len(record["battery"]) > 1000


def test_a_file_that_is_no_record_is_refused_in_one_line(tmp_path):
    import pytest

    (tmp_path / "plain.json.gz").write_text("not gzip")
    for bad in (tmp_path / "missing.json.gz", tmp_path / "plain.json.gz"):
        with pytest.raises(SystemExit, match=f"error: {bad}: not a record .*fix: name a file"):
            load(bad)
