"""The built-in example end to end: world -> vocab_map -> compare -> remap, as `make run` runs it (small sizes)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stages.common.checkpoint import DrafterCheckpoint
from stages.common.vocab import load_vocab_map

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["world.max_docs=400", "world.hidden_size=32", "world.tokenizer_vocab_size=1024",
         "world.draft_vocab_size=256", "vocab_map.draft_vocab_size=256"]


def regraft(outputs: Path, *overrides: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", *SMALL, *overrides],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted((outputs / "runs").iterdir())
    return json.loads((runs[-1] / "summary.json").read_text())


@pytest.mark.slow
def test_example_pipeline_end_to_end(tmp_path):
    summary = regraft(tmp_path)
    stages = summary["stages"]
    assert list(stages) == ["world", "vocab_map", "compare", "remap"]
    new_map = load_vocab_map(stages["vocab_map"]["out"])
    source_map = DrafterCheckpoint.open(summary["config"]["source"]["path"]).vocab_map()
    assert new_map.draft_vocab_size == source_map.draft_vocab_size == 256
    compare, remap = stages["compare"]["metrics"], stages["remap"]["metrics"]
    # domains A and B share most ids but few positions: the situation remap exists for
    assert compare["shared_ids"] > 128 and compare["positions_agree"] < 64
    assert remap["rows_remapped"] == compare["shared_ids"]
    assert remap["rows_remapped"] + remap["rows_from_fallback"] == 256
    remapped = DrafterCheckpoint.open(stages["remap"]["out"])
    assert remapped.vocab_map().target_ids.tolist() == new_map.target_ids.tolist()

    again = regraft(tmp_path, "remap.fallback=mean")
    assert again["stages"]["world"]["headline"] == "reused"
    assert again["stages"]["remap"]["metrics"]["rows_remapped"] == remap["rows_remapped"]


def test_bad_source_path_fails_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={tmp_path}", *SMALL,
                           f"source.path={tmp_path / 'missing_drafter'}", "source.builtin=false"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1
    assert "missing_drafter" in done.stdout + done.stderr and "error" in done.stdout + done.stderr
