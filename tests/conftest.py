"""Shared fixtures: a tiny real world (BPE tokenizer with a chat template, tiny Llama targets, drafters) built
once per test session from the same code the built-in example uses."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from stages.common import toy  # noqa: E402
from stages.common.vocab import VocabMap  # noqa: E402

USER_WORDS = "alpha bravo charlie kilo lima mike"
ASSISTANT_WORDS = "zulu yankee xray whiskey victor uniform"


def _corpus() -> list[str]:
    words = (USER_WORDS + " " + ASSISTANT_WORDS).split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20 + [
        "def remap(rows): return rows[::-1]  # the quick brown fox jumps over the lazy dog"] * 20


@pytest.fixture(scope="session")
def world_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("world")


@pytest.fixture(scope="session")
def tokenizer_dir(world_dir) -> Path:
    return toy.train_tokenizer(_corpus(), 300, world_dir / "tokenizer")


@pytest.fixture(scope="session")
def target_dir(world_dir, tokenizer_dir) -> Path:
    return toy.tiny_llama(tokenizer_dir, world_dir / "target", hidden_size=32, num_layers=4, num_heads=4)


@pytest.fixture(scope="session")
def tied_target_dir(world_dir, tokenizer_dir) -> Path:
    return toy.tiny_llama(tokenizer_dir, world_dir / "target_tied", hidden_size=32, num_layers=4, num_heads=4,
                          tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def vocab_size(target_dir) -> int:
    return json.loads((target_dir / "config.json").read_text())["vocab_size"]


def write_chats(path: Path, conversations: list[list[tuple[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) + "\n"
                            for conv in conversations))
    return path


def random_map(vocab_size: int, size: int, seed: int) -> VocabMap:
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    return VocabMap.from_target_ids(ids, vocab_size)


@pytest.fixture
def make_drafter(target_dir, tmp_path):
    def make(vocab_map: VocabMap, name: str = "drafter", layout: str = "sglang", seed: int = 0) -> Path:
        return toy.fresh_drafter(target_dir, vocab_map, tmp_path / name, layout=layout, seed=seed)

    return make
