"""The world stage's config (stages/world/): the built-in example world's sizes, steps and seed."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from omegaconf import MISSING

from stages.common.contract.stage import register_schema, setting


class BInit(str, Enum):
    a = "a"  # target A's weights: B is A trained further, as Kimi-K2.5 is to Kimi-K2
    # A's token embeddings and lm_head, but decoder layers and final norm from their own random init, trained on
    # domain A as A was, then on domain B: every hidden state a drafter trained on A reads is new, not a map of A's
    fresh = "fresh"
    new = "new"  # every weight from its own random init, token embeddings and lm_head too, trained on A then B


class BStyle(str, Enum):
    same = "same"  # B answers domain B's questions as the docstrings read
    # B writes what A never wrote (as a thinking model writes reasoning its predecessor did not), so a drafter's
    # learned continuations are a wrong prior: each answer's words in reverse order, or its tokens
    words_reversed = "words_reversed"
    tokens_reversed = "tokens_reversed"
    words_substituted = "words_substituted"  # each whole-word token written as another (a fixed permutation)


@dataclass
class WorldConfig:
    out: str = MISSING
    seed: int = 0  # every shuffle, init and batch order; the same seed builds the same world
    max_docs: int = setting(6000, at_least=1)  # stdlib docstrings (about 5,500 distinct ones, packages included), split a-m (A) / n-z (B)
    eval_docs: int = setting(64, at_least=1)  # held-out chats per domain for the targets' eval losses in the manifest
    tokenizer_vocab_size: int = setting(4096, at_least=256)  # byte-level BPE ids (the target vocab)
    hidden_size: int = setting(128, at_least=8)  # target width; a drafter copies width and heads
    num_layers: int = setting(4, at_least=2)  # target depth (aux layers 0, 1, 2)
    num_heads: int = setting(4, at_least=1)
    seq_len: int = setting(256, at_least=8)  # target training rows: whole chats packed into this many tokens
    batch_size: int = setting(4, at_least=1)  # rows per step: at equal compute, 4 x 256 beat 8 and 16 (eval loss 5.08 / 5.21 / 5.51)
    lr: float = setting(3e-3, above=0)  # AdamW peak lr for both targets (warmup, cosine to lr/10)
    steps_a: int = setting(200, at_least=1)  # target A's training steps on domain A (about 0.8 epochs)
    steps_b: int = setting(100, at_least=1)  # target B = target A trained this many more steps on domain B
    # the drifted world: B's residual stream rotated by exp(rotate_b x S) (0: none, 1: a full random rotation); its
    # answers stay the same, the states a drafter trained on A reads move (stages/world/toy.py)
    rotate_b: float = setting(0.0, at_least=0, at_most=1)
    b_init: BInit = BInit.a  # what target B starts from before its steps_b on domain B (BInit above)
    b_style: BStyle = BStyle.same  # how target B writes domain B's answers: its training chats and eval chats
    regen_prompts: int = setting(512, at_least=1)  # domain-B prompts whose answers target B regenerates into data_b.jsonl
    # sampled, as SpecForge documents its regeneration; 0: greedy, which on a target this small loops on ~30
    # distinct ids (a degenerate draft vocab for B)
    regen_temperature: float = setting(0.8, at_least=0)
    max_new_tokens: int = setting(64, at_least=1)  # longest regenerated answer; longer ones are cut (and kept, as in EAGLE-3 data)
    gen_batch_size: int = setting(64, at_least=1)  # prompts per batched generation (left padding)
    probe_prompts: int = setting(16, at_least=1)  # held-out domain-B prompts in prompts_b.jsonl for the probe
    probe_multi_turn: int = setting(4, at_least=0)  # how many of them carry a second user turn
    # torch CPU threads while building, fixed so that every machine builds the same world (reductions split by
    # thread); 0: torch's default (all cores: the world may then differ between machines). The world is the first
    # stage and builds alone: on 2 idle cores target A's first 20 steps took 20.7 s on 1 thread and 13.8 s on 2
    # (`python -m stages.world out=DIR steps_a=20 steps_b=2 regen_prompts=8 threads=N`); on 2 cores other jobs keep
    # busy, 2 threads ran 2.5x slower than 1 (world=tiny, built beside tests and sweeps, keeps 1)
    threads: int = setting(2, at_least=0)


register_schema("world", WorldConfig)
