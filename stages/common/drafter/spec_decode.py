"""Greedy EAGLE-3 speculative decoding with a local HF target (batch 1, chain drafting), and plain greedy decoding.

Per verify step the drafter proposes `num_steps` tokens one after another from its own KV cache; the target checks
them all in one forward pass over its KV cache and keeps the longest prefix that equals its own greedy choices,
plus its next token (the bonus). The result is token for token the target's plain greedy output: the drafter only
decides how many tokens one target forward emits.

Drafter alignment is the training one (`stages/common/drafter/ttt.py`): the drafter pair at position t is the target's aux
hidden state of token t with the embedding of token t+1, so every token the target has seen enters the drafter's
cache exactly once, paired with its successor.

accept_len = emitted tokens / target forwards, counting the prefill (it emits the first token): a drafter that is
never right gives exactly 1.0, a perfect one `num_steps + 1`. SGLang's `completion_tokens / spec_verify_ct` counts
decode-time verifies only, so it reads slightly higher on short answers.

Speed on CPU (bench/spec_decode.py): batch-1 decoding of a small target is per-call overhead, not arithmetic, so
both decoders run under `torch.inference_mode()` with `DECODE_THREADS` intra-op threads (one: splitting matmuls of
a few rows over threads only adds synchronisation, and when other jobs share the cores each parallel region waits
for a descheduled thread: forwards 5-40x slower with two threads on a loaded 2-core machine).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from stages.common.drafter.eagle3 import DraftOutput, Eagle3Drafter, KVCache
from stages.common.contract.runtime import torch_threads
from stages.common.drafter.target import TargetModel


DECODE_THREADS: int | None = 1  # intra-op threads while decoding on CPU; None leaves torch's setting


@contextlib.contextmanager
def decoding(model: torch.nn.Module) -> Iterator[None]:
    """Inference mode, and `DECODE_THREADS` intra-op threads while a CPU model decodes (restored afterwards)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    with torch_threads(DECODE_THREADS if on_cpu else None), torch.inference_mode():
        yield


@dataclass
class Generation:
    tokens: list[int]  # emitted after the prompt, stop token included
    target_forwards: int  # the prefill plus one verify per draft round
    accepted: list[int] = field(default_factory=list)  # drafts accepted in each verify step
    seconds: float = 0.0

    @property
    def accept_len(self) -> float:
        return len(self.tokens) / max(self.target_forwards, 1)


def target_forward(target: TargetModel, input_ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor]:
    """One cached forward over new tokens: their aux hidden states [T, 3H] and next-token logits [T, V]."""
    features = target.features(torch.tensor([input_ids]), past_key_values=cache)
    return features.aux_hidden[0], features.logits[0]


def crop(cache, length: int) -> None:
    """Drop the rejected drafts' keys and values (a negative count works across transformers versions)."""
    surplus = cache.get_seq_length() - length
    if surplus > 0:
        cache.crop(-surplus)


def finished(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    return len(tokens) >= max_new_tokens or not stop_ids.isdisjoint(tokens[-1:])


def clip(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The emitted tokens as plain greedy decoding would end them: at the budget or at the first stop token."""
    for index, token in enumerate(tokens[:max_new_tokens]):
        if token in stop_ids:
            return tokens[: index + 1]
    return tokens[:max_new_tokens]


def greedy_generate(target: TargetModel, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> Generation:
    """Plain greedy decoding with the target's KV cache: the reference and the tok/s baseline."""
    from transformers import DynamicCache

    start, cache, tokens = time.perf_counter(), DynamicCache(), []
    with decoding(target.model):
        _, logits = target_forward(target, prompt, cache)
        forwards = 1
        tokens.append(int(logits[-1].argmax()))
        while not finished(tokens, max_new_tokens, stop_ids):
            _, logits = target_forward(target, tokens[-1:], cache)
            forwards += 1
            tokens.append(int(logits[-1].argmax()))
    return Generation(tokens, forwards, seconds=time.perf_counter() - start)


class SpeculativeDecoder:
    """Chain drafting (top-k 1) with `num_steps` drafts per verify step."""

    def __init__(self, target: TargetModel, drafter: Eagle3Drafter, num_steps: int):
        self.target, self.drafter, self.num_steps = target, drafter.eval(), num_steps

    def feed_drafter(self, cache: KVCache, aux: torch.Tensor, next_tokens: list[int]) -> DraftOutput:
        """Append (aux hidden of token t, embedding of token t+1) pairs; return the last position's output."""
        embeds = self.target.embed(torch.tensor([next_tokens]))
        return self.drafter(embeds, self.drafter.project_aux(aux[None].to(embeds.dtype)), cache=cache)

    def draft(self, cache: KVCache, aux: torch.Tensor, next_tokens: list[int]) -> list[int]:
        """Feed the newly verified tokens, then draft `num_steps` target ids from the drafter's own outputs."""
        out = self.feed_drafter(cache, aux, next_tokens)
        verified_length = cache.length
        drafts = []
        for step in range(self.num_steps):
            draft_id = out.logits[0, -1].argmax()
            drafts.append(int(self.drafter.draft_to_target(draft_id)))
            if step + 1 < self.num_steps:
                embeds = self.target.embed(torch.tensor([[drafts[-1]]]))
                out = self.drafter(embeds, out.hidden[:, -1:], cache=cache)
        cache.truncate(verified_length)  # drafts enter the cache only once the target has verified them
        return drafts

    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> Generation:
        from transformers import DynamicCache

        start, target_cache, drafter_cache = time.perf_counter(), DynamicCache(), KVCache()
        with decoding(self.target.model):
            aux, logits = target_forward(self.target, prompt, target_cache)
            generation = Generation(tokens=[int(logits[-1].argmax())], target_forwards=1)
            fed = prompt[1:] + generation.tokens  # successors of the tokens whose aux states are in `aux`
            while not finished(generation.tokens, max_new_tokens, stop_ids):
                drafts = self.draft(drafter_cache, aux, fed)
                seen = target_cache.get_seq_length()
                aux, logits = target_forward(self.target, generation.tokens[-1:] + drafts, target_cache)
                generation.target_forwards += 1
                choices = logits.argmax(-1).tolist()
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
                    accepted += 1
                generation.accepted.append(accepted)
                new_tokens = drafts[:accepted] + [choices[accepted]]
                crop(target_cache, seen + accepted + 1)
                aux = aux[: accepted + 1]
                fed = new_tokens
                generation.tokens += new_tokens
                if not stop_ids.isdisjoint(new_tokens):
                    break
        generation.tokens = clip(generation.tokens, max_new_tokens, stop_ids)
        generation.seconds = time.perf_counter() - start
        return generation
