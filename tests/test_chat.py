"""Assistant masks: the offsets path (fast tokenizers) and the span path (tokenizers without offsets, such as Kimi's
tiktoken one) give the same ids and the same mask, and the mask covers exactly the assistant turns. A Kimi-style
tokenizer (tests/tiktoken_standin.py: tiktoken ranks, its class in its folder) loads only when trusted, and then
builds the same draft vocab as the fast tokenizer it was made from."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stages import vocab_map
from stages.world import toy
from stages.common.data.chat import encode_by_spans, encode_chats, load_tokenizer, read_conversations, \
    render_with_assistant_spans
from stages.common.contract.stage import compose_stage
from stages.common.contract.errors import RegraftError
from stages.common.drafter.vocab import load_vocab_map
from tests import tiktoken_standin

CONVERSATIONS = [
    [{"role": "user", "content": "alpha bravo"}, {"role": "assistant", "content": "zulu yankee xray"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": " kilo"},
     {"role": "assistant", "content": " whiskey victor"}, {"role": "user", "content": "lima\nmike"},
     {"role": "assistant", "content": "uniform  zulu\n"}],
    [{"role": "user", "content": "def remap(rows): return rows[::-1]"}, {"role": "assistant", "content": "rows"}],
]


def test_spans_give_the_ids_and_mask_of_offsets(tokenizer_dir, chats):
    tokenizer = load_tokenizer(tokenizer_dir)
    conversations = CONVERSATIONS + list(read_conversations(chats))
    by_offsets = encode_chats(tokenizer, conversations)
    for messages, (ids, mask) in zip(conversations, by_offsets):
        text, spans = render_with_assistant_spans(tokenizer, messages)
        span_ids, span_mask = encode_by_spans(tokenizer, text, spans)
        assert np.array_equal(span_ids, ids) and np.array_equal(span_mask, mask), text


def test_the_mask_covers_each_assistant_turn_and_its_end_marker(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    text, spans = render_with_assistant_spans(tokenizer, CONVERSATIONS[1])
    ids, mask = encode_by_spans(tokenizer, text, spans)
    assert tokenizer.decode(ids[mask].tolist()) == " whiskey victor<|end|>\nuniform  zulu\n<|end|>\n"
    truncated_ids, truncated_mask = encode_by_spans(tokenizer, text, spans, max_length=7)
    assert np.array_equal(truncated_ids, ids[:7]) and np.array_equal(truncated_mask, mask[:7])


@pytest.fixture(scope="module")
def kimi_style(tokenizer_dir, tmp_path_factory) -> Path:
    return tiktoken_standin.build(tokenizer_dir, tmp_path_factory.mktemp("kimi_style"), toy.SPECIAL_TOKENS)


def test_a_tokenizer_in_its_folder_loads_only_when_trusted(kimi_style):
    with pytest.raises(RegraftError, match=r"code in its folder .* set target.trust_remote_code=true"):
        load_tokenizer(kimi_style)
    assert not load_tokenizer(kimi_style, trust_remote_code=True).is_fast


def test_a_tiktoken_tokenizer_without_offsets_gives_the_fast_tokenizers_ids_and_masks(kimi_style, tokenizer_dir,
                                                                                        chats):
    conversations = CONVERSATIONS + list(read_conversations(chats))
    fast = encode_chats(load_tokenizer(tokenizer_dir), conversations)
    slow = encode_chats(load_tokenizer(kimi_style, trust_remote_code=True), conversations)
    for (fast_ids, fast_mask), (slow_ids, slow_mask) in zip(fast, slow):
        assert np.array_equal(slow_ids, fast_ids) and np.array_equal(slow_mask, fast_mask)


def test_vocab_map_on_a_kimi_style_tokenizer_equals_the_fast_one(kimi_style, tokenizer_dir, chats, tmp_path):
    def build(tokenizer: Path, name: str, *extra: str):
        vocab_map.run(compose_stage("vocab_map", [f"tokenizer={tokenizer}", f"data={chats}", f"out={tmp_path / name}",
                                                  "draft_vocab_size=32", *extra]))
        return load_vocab_map(tmp_path / name)

    fast, slow = build(tokenizer_dir, "fast"), build(kimi_style, "slow", "trust_remote_code=true")
    assert torch.equal(slow.d2t, fast.d2t) and torch.equal(slow.t2d, fast.t2d)
