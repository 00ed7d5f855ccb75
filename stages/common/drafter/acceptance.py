"""Acceptance of a drafter on a target, as the probe measures it: the prompts of each eval set, asked turn by turn on
the conversation so far, and accept_len pooled over turns (emitted tokens over target forwards), per set and over
all sets. The probe stage (stages/probe.py) and the fine-tune's in-training evaluation (stages/finetune/acceptance.py)
both read their prompts and count through here, so a curve logged while training and the probe's figure are one
measurement on different prompts.

    conversations, sets = load_eval_sets(eval_sets, count=4, seed=0, skip=8)   # the 4 after the probe's 8
    rows = decoded_turns(SpeculativeDecoder(target, drafter, 3), conversations, tokenizer, 32, stops)
    accept_length(rows), per_set(rows, sets)
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from stages.common.contract.errors import RegraftError
from stages.common.data.chat import read_conversations
from stages.common.data.chat_prompts import prompt_ids
from stages.common.drafter.spec_decode import SpeculativeDecoder

BUILTIN_PROMPTS = [
    ["What does `os.path.join` do?"],
    ["Explain `json.dumps` from the json module."],
    ["How do I use `random.choice`?", "And what does it raise on an empty sequence?"],
    ["What does `re.sub` do?"],
    ["Explain `string.Template` from the string module."],
    ["How do I use `textwrap.dedent`?"],
    ["What does `shutil.copytree` do?", "How is it different from `shutil.copy2`?"],
    ["Explain `statistics.median` from the statistics module."],
]



def accept_length(rows: list[dict]) -> float:
    """Sum of completion tokens over sum of verify steps (SpecForge's benchmarks; MT-Bench sums both turns)."""
    steps = sum(row["verify_steps"] for row in rows)
    if steps <= 0:
        raise RegraftError(None, f"no verify steps in {len(rows)} rows: nothing was generated",
                           "give the probe prompts and max_new_tokens > 0")
    return sum(row["completion_tokens"] for row in rows) / steps


def load_prompts(source: str, count: int, seed: int, skip: int = 0) -> list[list[str]]:
    """Conversations as lists of user turns, picked by a seeded shuffle: the `count` after the first `skip` (a slice
    held out from the probe's, which takes the first ones)."""
    if source == "builtin":
        conversations = [list(turns) for turns in BUILTIN_PROMPTS]
    else:
        conversations = [[m["content"] for m in messages if m["role"] == "user"]
                         for messages in read_conversations(Path(source))]
        conversations = [turns for turns in conversations if turns]
    if not conversations:
        raise RegraftError(source, "no user turns to ask", "give eval_sets chats with at least one user message")
    random.Random(seed).shuffle(conversations)
    return conversations[skip:skip + count]


def load_eval_sets(eval_sets: list, count: int, seed: int, skip: int = 0) -> tuple[list[list[str]], list[str]]:
    """Every set's conversations, one after another, and the set each one is from."""
    conversations, sets = [], []
    for entry in eval_sets:
        picked = load_prompts(str(entry.path), count, seed, skip)
        conversations += picked
        sets += [entry.name] * len(picked)
    return conversations, sets


def accept_length_per_request(rows: list[dict]) -> float:
    """The mean over requests (turns) of each one's completion tokens over its verify steps: what a benchmark that
    averages per-request acceptance reports (SGLang's per-request `spec_accept_length`, averaged). It weighs a short
    answer as much as a long one, so it can rank two drafters unlike `accept_length`, the pooled figure regraft
    decides by (vLLM's and SpecForge's benchmarker's)."""
    counted = [row for row in rows if row["verify_steps"] > 0]
    if not counted:
        return accept_length(rows)  # says why in one line
    return sum(row["completion_tokens"] / row["verify_steps"] for row in counted) / len(counted)


def per_set(rows: list[dict], sets: list[str]) -> dict[str, float]:
    """accept_len (pooled and per-request), completed tokens and turns of each set (`accept_len/<set>`, ...); rows
    gain their `set`."""
    for row in rows:
        row["set"] = sets[row["conversation"]]
    metrics: dict[str, float] = {}
    for name in dict.fromkeys(sets):
        mine = [row for row in rows if row["set"] == name]
        metrics.update({f"accept_len/{name}": accept_length(mine),
                        f"accept_len_per_request/{name}": accept_length_per_request(mine),
                        f"completion_tokens/{name}": sum(row["completion_tokens"] for row in mine),
                        f"turns/{name}": len(mine)})
    return metrics


def chat_renderer(tokenizer):
    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    return render


WARM_UP = [{"role": "user", "content": "hi"}]


def asked_turns(conversations: list[list[str]], tokenizer, desc: str) -> Iterator[tuple[int, int, list[int], list]]:
    """(conversation, turn, prompt ids, messages) for every user turn in order, on the conversation so far; the
    caller appends its answer to `messages` before the next turn is rendered."""
    turns = [(c, t) for c, conversation in enumerate(conversations) for t in range(len(conversation))]
    messages: list[dict] = []
    for c, t in tqdm(turns, desc=desc, unit="turn"):
        messages = [] if t == 0 else messages
        messages.append({"role": "user", "content": conversations[c][t]})
        yield c, t, prompt_ids(tokenizer, messages), messages


def decoded_turns(decoder: SpeculativeDecoder, conversations: list[list[str]], tokenizer, max_new_tokens: int,
                  stops: set[int], desc: str = "acceptance") -> list[dict]:
    """Every turn decoded speculatively (greedy, so the answer is the target's own), each answer kept in the
    conversation for its next turn; a row per turn with what accept_len pools."""
    rows = []
    for c, t, prompt, messages in asked_turns(conversations, tokenizer, desc):
        spec = decoder.generate(prompt, max_new_tokens, stops)
        messages.append({"role": "assistant", "content": tokenizer.decode(spec.tokens, skip_special_tokens=True)})
        rows.append({"conversation": c, "turn": t, "completion_tokens": len(spec.tokens),
                     "verify_steps": spec.target_forwards})
    return rows
