"""vocab_map: assistant-only counting, the field's map format, coverage, the three map sources, errors, CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from stages import vocab_map
from stages.common.contract.stage import compose_stage
from stages.common.contract.errors import RegraftError
from stages.common.drafter.vocab import build_vocab_map, load_vocab_map
from tests.conftest import ASSISTANT_WORDS, USER_WORDS, random_map, write_chats  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def run_stage(tokenizer_dir: Path, data: Path, out: Path, size: int = 16, *extra: str):
    cfg = compose_stage("vocab_map", [f"tokenizer={tokenizer_dir}", f"data={data}", f"out={out}",
                                      f"draft_vocab_size={size}", *extra])
    return vocab_map.run(cfg)


def ids_of(tokenizer, text: str) -> set[int]:
    return set(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture
def chats(tmp_path) -> Path:
    users, assistants = USER_WORDS.split(), ASSISTANT_WORDS.split()
    conversations = [[("user", f"{users[i % 6]} {users[(i + 1) % 6]}"), ("assistant", assistants[i % 6]),
                      ("user", users[(i + 2) % 6]), ("assistant", f"{assistants[(i + 3) % 6]} zulu")]
                     for i in range(12)]
    return write_chats(tmp_path / "chats.jsonl", conversations)


def test_counts_only_assistant_tokens(target_dir, chats, tmp_path):
    result = run_stage(target_dir, chats, tmp_path / "map", size=64)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    counts = load_file(tmp_path / "map" / "vocab_map.safetensors")["token_counts"]
    assistant = ids_of(tokenizer, ASSISTANT_WORDS) | ids_of(tokenizer, " zulu") | ids_of(tokenizer, "<|end|>\n")
    user_side = ids_of(tokenizer, USER_WORDS) | ids_of(tokenizer, "<|user|>\n") | ids_of(tokenizer, "<|assistant|>\n")
    user_only = user_side - assistant
    assert len(user_only) >= 8  # the data proves something only if user turns use tokens of their own
    assert all(counts[i] == 0 for i in user_only)
    assert set(torch.nonzero(counts).flatten().tolist()) <= assistant
    # two assistant turns per conversation, each ends with <|end|> after its content
    assert counts[tokenizer.convert_tokens_to_ids("<|end|>")] == 24
    # hand count: tokenise each assistant turn's rendered text and add up
    expected = torch.zeros_like(counts)
    for line in chats.read_text().splitlines():
        for message in json.loads(line)["messages"]:
            if message["role"] == "assistant":
                for token in tokenizer(message["content"] + "<|end|>\n", add_special_tokens=False)["input_ids"]:
                    expected[token] += 1
    assert torch.equal(counts, expected)
    assert result.metrics["assistant_tokens"] == int(expected.sum())


def test_map_is_built_exactly_as_the_field_does(target_dir, chats, tmp_path):
    run_stage(target_dir, chats, tmp_path / "map", size=64)
    tensors = load_file(tmp_path / "map" / "vocab_map.safetensors")
    counts, d2t, t2d = tensors["token_counts"], tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (64,) and t2d.dtype == torch.bool and t2d.sum() == 64
    target_ids = d2t + torch.arange(64)
    assert torch.all(target_ids[1:] > target_ids[:-1])
    assert torch.equal(torch.nonzero(t2d).flatten(), target_ids)
    seen = torch.nonzero(counts).flatten()
    assert set(seen.tolist()) <= set(target_ids.tolist())  # every counted id is in (fewer than 64 distinct)
    padding = sorted(set(target_ids.tolist()) - set(seen.tolist()))
    assert padding == [i for i in range(64 + len(seen)) if i not in set(seen.tolist())][: len(padding)]


def test_top_n_breaks_ties_by_lower_id_and_pads_from_low_ids():
    counts = torch.tensor([0, 5, 3, 5, 0, 3, 9, 0, 1, 0], dtype=torch.int64)
    assert build(counts, 3).tolist() == [1, 3, 6]
    assert build(counts, 4).tolist() == [1, 2, 3, 6]  # ids 2 and 5 tie at 3: the lower one wins
    assert build(counts, 8).tolist() == [0, 1, 2, 3, 4, 5, 6, 8]  # six seen ids, padded with 0 and 4
    vmap = build_vocab_map(counts, 4)
    assert vmap.d2t.tolist() == [1, 1, 1, 3] and vmap.t2d.tolist() == [0, 1, 1, 1, 0, 0, 1, 0, 0, 0]


def build(counts: torch.Tensor, size: int) -> torch.Tensor:
    return build_vocab_map(counts, size).target_ids


def test_manifest_reports_sizes_and_coverage(target_dir, chats, tmp_path):
    result = run_stage(target_dir, chats, tmp_path / "map", size=4)
    manifest = json.loads((tmp_path / "map" / "manifest.json").read_text())
    counts = load_file(tmp_path / "map" / "vocab_map.safetensors")["token_counts"]
    top4 = torch.sort(counts, descending=True, stable=True).values[:4].sum()
    assert manifest["complete"] is True and manifest["stage"] == "vocab_map"
    assert manifest["metrics"]["coverage"] == pytest.approx(float(top4) / float(counts.sum()))
    assert manifest["metrics"]["conversations"] == 12
    assert manifest["metrics"]["vocab_size"] == counts.numel() and manifest["vocab_size_source"].endswith("config.json")
    assert {"vocab_map.safetensors", "coverage.png"} <= set(manifest["files"])
    assert result.metrics["coverage"] < 1.0


def test_three_map_sources_read_the_same(target_dir, chats, tmp_path, make_drafter):
    run_stage(target_dir, chats, tmp_path / "map", size=32)
    from_stage = load_vocab_map(tmp_path / "map")
    torch.save({"d2t": from_stage.d2t, "t2d": from_stage.t2d}, tmp_path / "specforge.pt")
    from_pt = load_vocab_map(tmp_path / "specforge.pt")
    from_drafter = load_vocab_map(make_drafter(from_stage))
    for other in (from_pt, from_drafter):
        assert torch.equal(other.d2t, from_stage.d2t) and torch.equal(other.t2d, from_stage.t2d)


@pytest.mark.parametrize("payload, message", [
    ({"d2t": torch.tensor([0, 0, 0]), "t2d": torch.tensor([True, True, True, False])}, None),
    ({"d2t": torch.tensor([0, 0, 5]), "t2d": torch.tensor([True, True, False, False])}, "outside the target vocab"),
    ({"d2t": torch.tensor([0, 0], dtype=torch.int32), "t2d": torch.tensor([True, True])}, "d2t must be int64"),
    ({"d2t": torch.tensor([0, 0]), "t2d": torch.tensor([True, True, True])}, "t2d marks 3 ids"),
    ({"d2t": torch.tensor([1, 0]), "t2d": torch.tensor([False, True, False])}, "same target id"),
    ({"t2d": torch.tensor([True])}, "has no d2t"),
    ([1, 2], "holds no dict"),
])
def test_map_validation(tmp_path, payload, message):
    torch.save(payload, tmp_path / "map.pt")
    if message is None:
        assert load_vocab_map(tmp_path / "map.pt").draft_vocab_size == 3
        return
    with pytest.raises(RegraftError, match=message) as error:
        load_vocab_map(tmp_path / "map.pt")
    assert str(tmp_path / "map.pt") in str(error.value)


def test_bad_inputs_give_one_line_naming_the_file(target_dir, tokenizer_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{not json}\n")
    with pytest.raises(RegraftError, match=rf"{bad}:2: not a chat line"):
        run_stage(target_dir, bad, tmp_path / "out")
    with pytest.raises(RegraftError, match="chat data not found"):
        run_stage(target_dir, tmp_path / "missing.jsonl", tmp_path / "out")
    only_users = write_chats(tmp_path / "users.jsonl", [[("user", "alpha")]])
    with pytest.raises(RegraftError, match="no assistant tokens"):
        run_stage(target_dir, only_users, tmp_path / "out")
    chats = write_chats(tmp_path / "c.jsonl", [[("user", "alpha"), ("assistant", "zulu")]])
    with pytest.raises(RegraftError, match="exceeds the target vocab"):
        run_stage(target_dir, chats, tmp_path / "out", size=100_000)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_missing_chat_template_is_refused(tokenizer_dir, tmp_path):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    plain = tmp_path / "plain_tokenizer"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    chats = write_chats(tmp_path / "c.jsonl", [[("user", "alpha"), ("assistant", "zulu")]])
    with pytest.raises(RegraftError, match="no chat template"):
        run_stage(plain, chats, tmp_path / "out")


def test_cli_runs_alone_and_rejects_typos(target_dir, chats, tmp_path):
    base = [sys.executable, "-m", "stages.vocab_map", f"tokenizer={target_dir}", f"data={chats}"]
    ok = subprocess.run(base + [f"out={tmp_path / 'm'}", "draft_vocab_size=8"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert load_vocab_map(tmp_path / "m").draft_vocab_size == 8 and "draft ids cover" in ok.stdout
    typo = subprocess.run(base + [f"out={tmp_path / 'n'}", "draft_vocab_sise=8"], cwd=ROOT, capture_output=True,
                          text=True)
    assert typo.returncode == 2 and "draft_vocab_sise" in typo.stderr
    missing = subprocess.run(base, cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 1 and "no value for out" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
