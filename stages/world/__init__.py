"""world stage: the built-in example world, a miniature of the real situation regraft exists for.

A drafter trained for target A must serve target B, a later version of A (as Kimi-K2.5 is to Kimi-K2). Stdlib
docstrings become chats in two domains (A: modules a-m, B: n-z). Target A is a tiny Llama trained on A; target B is
target A trained further on B (or, with `b_init=fresh`, A's token weights on a decoder of its own, and with
`b_style`, answers written otherwise: a B where scratch may win); B's training chats carry target B's own answers
(sampled at `regen_temperature`, as SpecForge regenerates EAGLE-3 data; greedy at 0). The source drafter is not
built here: the pipeline trains it for target A with its own vocab_map and finetune stages (`source=toy`,
pipelines/core/dag.py).

Out (HF `save_pretrained` folders, chat JSONL `{"messages": [...]}`): `tokenizer/`, `data_a.jsonl`, `target_a/`,
`target_b/`, `data_b.jsonl` (domain-B prompts, target B's answers), `prompts_b.jsonl` (held-out domain-B user turns,
some two-turn, for probes), `prompts_b_prose.jsonl` and `prompts_b_code.jsonl` (held-out domain-B user turns
about docstrings that are prose, and about those heavy in code: the default eval sets), `manifest.json` (losses, target B's greedy top-1 probability, counts, seconds per
phase, `digest`: a sha256 over the weights and data, `cpu`: the settings it was computed under). Deterministic
for a seed (training runs by step count) and the same on every x86 CPU: the build runs under
`stages.common.contract.runtime.SAME_ON_EVERY_CPU` (MKL's compatible code path, ATen's AVX2 kernels) with a fixed thread
count, in a fresh interpreter if this one already computed under other settings. About 2-3 minutes on 2 CPU cores.

    python -m stages.world out=DIR [steps_a=... regen_prompts=...]
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from stages.common.contract.artifacts import read_manifest, staged_output
from stages.common.data.chat import load_tokenizer
from stages.common.contract.errors import RegraftError
from stages.common.contract.runtime import SAME_ON_EVERY_CPU, same_on_every_cpu, torch_threads
from stages.common.contract.stage import StageResult
from stages.world.corpus import (Docstring, as_conversation, file_docstrings, in_style, stdlib_source_files,
                                 write_jsonl)
from stages.world.toy import (assistant_loss, fit_causal_lm, fresh_decoder, generate_answers, pack_chats,
                              rotate_residual_stream, tiny_llama, train_tokenizer)


@dataclass
class Domains:
    """The docstrings of the world by role; no chat appears in two roles."""

    train_a: list[Docstring]
    eval_a: list[Docstring]
    train_b: list[Docstring]  # target B trains on these; data_b's prompts come from them
    eval_b: list[Docstring]
    probes: list[Docstring]  # held out from target B's training and from data_b


def split_docs(cfg: DictConfig) -> Domains:
    """Stdlib files in a seeded order, parsed until `max_docs` distinct docstrings are found (all of them by
    default), then shuffled and split by domain and role."""
    files = stdlib_source_files()
    rng = random.Random(cfg.seed)
    rng.shuffle(files)
    docs, seen = [], set()
    for path in files:
        for doc in file_docstrings(path):  # one chat per text and per name, so roles never share a prompt
            if doc.text not in seen and (doc.module, doc.name) not in seen:
                seen.update((doc.text, (doc.module, doc.name)))
                docs.append(doc)
        if len(docs) >= cfg.max_docs:
            break
    rng.shuffle(docs)
    docs = docs[: cfg.max_docs]
    a = [doc for doc in docs if doc.domain == "a"]
    b = [doc for doc in docs if doc.domain == "b"]
    probes = cfg.probe_prompts + cfg.probe_multi_turn
    if len(a) < 2 * cfg.eval_docs + 1 or len(b) < 2 * cfg.eval_docs + probes + 1:
        raise RegraftError(None, f"{len(a)} + {len(b)} docstrings are too few for {cfg.eval_docs} eval docs and "
                           f"{probes} probe turns per domain", "raise max_docs or lower eval_docs/probe_prompts")
    held = cfg.eval_docs + probes
    return Domains(train_a=a[cfg.eval_docs:], eval_a=a[: cfg.eval_docs], train_b=b[held:],
                   eval_b=b[: cfg.eval_docs], probes=b[cfg.eval_docs: held])


def eval_sets(docs: list[Docstring], count: int, multi_turn: int) -> dict[str, list[dict]]:
    """The held-out domain-B docstrings as two eval sets that differ in kind: prose questions, and code questions
    (about docstrings heavy in code), which a target trained on the world's chats answers with code."""
    code = [doc for doc in docs if doc.heavy_in_code]
    prose = [doc for doc in docs if not doc.heavy_in_code]
    if not code or len(prose) < count + multi_turn:
        raise RegraftError(None, f"{len(prose)} prose and {len(code)} code-heavy held-out docstrings are too few for "
                           f"{count} probe prompts per set", "raise max_docs or eval_docs, or lower probe_prompts")
    return {"prose": probe_rows(prose, count, multi_turn), "code": probe_rows(code, min(count, len(code)), 0)}


def chats(docs: list[Docstring], style: str = "same", tokenizer=None) -> list[list[dict]]:
    """The docstrings as chats, their answers written in `style` (WorldConfig.b_style)."""
    return [in_style(as_conversation(doc, index)["messages"], style, tokenizer) for index, doc in enumerate(docs)]


def probe_rows(docs: list[Docstring], count: int, multi_turn: int) -> list[dict]:
    """User turns only: `count` prompts, the last `multi_turn` of them with a second user turn (MT-Bench style)."""
    first, second = docs[:count], docs[count:]
    rows = []
    for index, doc in enumerate(first):
        turns = [as_conversation(doc, index)["messages"][0]]
        later = index - (count - multi_turn)
        if later >= 0:
            turns.append(as_conversation(second[later], index + 1)["messages"][0])
        rows.append({"messages": turns})
    return rows


class Phases:
    """Seconds per phase, for the manifest."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 2)


def train_target(model, tokenizer, docs: list[Docstring], cfg: DictConfig, steps: int, seed: int, name: str,
                 style: str = "same") -> float:
    losses = fit_causal_lm(model, pack_chats(tokenizer, chats(docs, style, tokenizer), cfg.seq_len), steps, cfg.lr,
                           cfg.batch_size, seed, desc=f"world: {name}")
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


# what the world's digest covers, in this order: its weights and data (not the configs beside the weights, which
# carry the transformers version)
DIGESTED = ("tokenizer/tokenizer.json", "data_a.jsonl", "target_a/model.safetensors", "target_b/model.safetensors",
            "data_b.jsonl", "prompts_b.jsonl", "prompts_b_prose.jsonl", "prompts_b_code.jsonl")
FRESH = "REGRAFT_WORLD_FRESH"  # set in the fresh interpreter run() starts, so that it builds whatever it finds


def digest(root: str | Path) -> str:
    """sha256 over DIGESTED (each file's name, then its bytes): one hex string that names the world."""
    total = hashlib.sha256()
    for name in DIGESTED:
        total.update(name.encode() + b"\0")
        with open(Path(root) / name, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                total.update(chunk)
    return total.hexdigest()


def run(cfg: DictConfig) -> StageResult:
    cpu = same_on_every_cpu()
    if not cpu["in_effect"] and not os.environ.get(FRESH):
        return run_in_fresh_interpreter(cfg)
    with torch_threads(cfg.threads):
        import torch

        return build(cfg, {**cpu, "threads": torch.get_num_threads()})


def run_in_fresh_interpreter(cfg: DictConfig) -> StageResult:
    """This process computed under other settings before (a test session, an inline launcher): the settings
    cannot change any more, so `python -m stages.world` builds it under them (os.environ holds them now)."""
    overrides = [f"{key}={json.dumps(value) if isinstance(value, str) else value}"
                 for key, value in OmegaConf.to_container(cfg, resolve=True).items()]
    subprocess.run([sys.executable, "-m", "stages.world", *overrides], env={**os.environ, FRESH: "1"},
                   stdout=sys.stderr, check=False)
    manifest = read_manifest(cfg.out)
    if manifest is None:
        raise RegraftError(cfg.out, "the world build in a fresh interpreter left no complete output",
                           "its error is printed above; run `python -m stages.world out=...` to see it alone")
    return StageResult(Path(cfg.out), manifest["metrics"], manifest.get("headline", ""))


def start_of_b(model_a, tokenizer, domains: Domains, cfg: DictConfig, metrics: dict) -> object:
    """Target B before its steps on domain B: target A itself (b_init=a), or A's token embeddings and lm_head on a
    fresh decoder trained on domain A as A was (b_init=fresh), so that B knows what A knows in states of its own."""
    if cfg.b_init == "a":
        return copy.deepcopy(model_a)
    model_b = fresh_decoder(model_a, seed=cfg.seed + 3, keep_tokens=cfg.b_init == "fresh")
    metrics["target_b_train_loss_a"] = train_target(model_b, tokenizer, domains.train_a, cfg, cfg.steps_a,
                                                    cfg.seed + 3, "target_b on domain a")
    return model_b


def build(cfg: DictConfig, cpu: dict) -> StageResult:
    from transformers import AutoModelForCausalLM

    phase, metrics, started = Phases(), {}, time.perf_counter()
    with phase("corpus"):
        domains = split_docs(cfg)
    with staged_output(cfg.out, "world", cfg) as staged:
        root = staged.path
        with phase("tokenizer"):
            write_jsonl([{"messages": m} for m in chats(domains.train_a)], root / "data_a.jsonl")
            every = domains.train_a + domains.eval_a + domains.train_b + domains.eval_b + domains.probes
            texts = [doc.text for doc in every] + [m["content"] for c in chats(every[:200]) for m in c]
            tokenizer_dir = train_tokenizer(texts, cfg.tokenizer_vocab_size, root / "tokenizer")
            tokenizer = load_tokenizer(tokenizer_dir)
        with phase("target_a"):
            tiny_llama(tokenizer_dir, root / "target_a", cfg.hidden_size, cfg.num_layers, cfg.num_heads, seed=cfg.seed)
            model_a = AutoModelForCausalLM.from_pretrained(root / "target_a")
            metrics["target_a_train_loss"] = train_target(model_a, tokenizer, domains.train_a, cfg, cfg.steps_a,
                                                          cfg.seed, "target_a")
            model_a.save_pretrained(root / "target_a")
        with phase("target_b"):
            model_b = start_of_b(model_a, tokenizer, domains, cfg, metrics)
            metrics["target_b_train_loss"] = train_target(model_b, tokenizer, domains.train_b, cfg, cfg.steps_b,
                                                          cfg.seed + 1, "target_b", cfg.b_style)
            if cfg.rotate_b > 0:  # B's function unchanged, its every hidden state h Q: drift the drafter sees
                rotate_residual_stream(model_b, dose=cfg.rotate_b, seed=cfg.seed + 2)
            model_b.save_pretrained(root / "target_b")
            tokenizer.save_pretrained(root / "target_b")
        with phase("eval"):
            for model, name in ((model_a, "a"), (model_b, "b")):
                for docs, domain in ((domains.eval_a, "a"), (domains.eval_b, "b")):
                    written = chats(docs, cfg.b_style if domain == "b" else "same", tokenizer)  # as B writes it
                    metrics[f"target_{name}_eval_loss_{domain}"] = assistant_loss(model, tokenizer, written,
                                                                                  cfg.seq_len)
        with phase("regenerate"):
            prompts = [c[:1] for c in chats(domains.train_b)][: cfg.regen_prompts]
            answers = generate_answers(model_b, tokenizer, prompts, cfg.max_new_tokens, cfg.gen_batch_size,
                                       cfg.regen_temperature, cfg.seed, desc="world: regenerate data_b")
            write_jsonl([{"messages": p + [{"role": "assistant", "content": text}]}
                         for p, text in zip(prompts, answers.texts)], root / "data_b.jsonl")
            probes = probe_rows(domains.probes, cfg.probe_prompts, cfg.probe_multi_turn)
            write_jsonl(probes, root / "prompts_b.jsonl")
            for name, rows in eval_sets(domains.eval_b + domains.probes, cfg.probe_prompts,
                                        cfg.probe_multi_turn).items():
                write_jsonl(rows, root / f"prompts_b_{name}.jsonl")
                metrics[f"eval_set_{name}"] = len(rows)
            greedy = generate_answers(model_b, tokenizer, [row["messages"][:1] for row in probes], cfg.max_new_tokens,
                                      cfg.gen_batch_size, desc="world: greedy on prompts_b")
            metrics.update(target_b_greedy_top1=greedy.mean_top1, greedy_distinct_ids=greedy.distinct_ids,
                           regen_tokens=answers.tokens, regen_distinct_ids=answers.distinct_ids,
                           regen_unfinished=answers.finished.count(False))
        metrics.update(docs_a=len(domains.train_a) + len(domains.eval_a), docs_b=len(domains.train_b) +
                       len(domains.eval_b) + len(domains.probes), data_a_chats=len(domains.train_a),
                       data_b_chats=len(prompts), probe_prompts=cfg.probe_prompts, vocab_size=len(tokenizer))
        metrics.update({f"seconds_{name}": seconds for name, seconds in phase.seconds.items()})
        metrics["seconds_total"] = round(time.perf_counter() - started, 2)
        headline = (f"target loss A {metrics['target_a_eval_loss_a']:.2f}, B {metrics['target_b_eval_loss_b']:.2f}; "
                    f"{len(prompts)} regenerated chats, target B greedy top-1 {metrics['target_b_greedy_top1']:.2f}")
        if not cpu["in_effect"]:
            print(f"world: built under {cpu}, not the settings every x86 CPU shares ({SAME_ON_EVERY_CPU}): "
                  "another machine may build another world", file=sys.stderr)
        staged.update(metrics=metrics, headline=headline, digest=digest(root), cpu=cpu)
    return StageResult(Path(cfg.out), metrics, headline)
