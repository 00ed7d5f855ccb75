"""world stage: the built-in example world, a miniature of the real situation regraft exists for.

A drafter trained for target A must serve target B, a later version of A (as Kimi-K2.5 is to Kimi-K2). Stdlib
docstrings become chats in two domains (A: modules a-m, B: n-z). Target A is a tiny Llama trained on A; target B
is target A trained further on B; the source drafter is trained (by the finetune stage) on target A with A's draft
vocab; B's training chats carry target B's own answers (sampled at `regen_temperature`, as SpecForge regenerates
EAGLE-3 data; greedy at 0).

Out (HF `save_pretrained` folders, chat JSONL `{"messages": [...]}`, drafters in the SGLang layout):
`tokenizer/`, `data_a.jsonl`, `target_a/`, `target_b/`, `data_b.jsonl` (domain-B prompts, target B's answers),
`prompts_b.jsonl` (held-out domain-B user turns, some two-turn, for probes), `drafter_a/`, `manifest.json` (losses,
the drafter's validation metrics, target B's greedy top-1 probability, the A-vs-B draft vocab overlap, counts,
seconds per phase). Deterministic for a seed (training runs by step count); about 3-4 minutes on 2 CPU cores.

    python -m stages.world out=DIR [steps_a=... regen_prompts=...]
"""
from __future__ import annotations

import contextlib
import copy
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING, DictConfig

from stages.common.artifacts import staged_output
from stages.common.chat import load_tokenizer, read_conversations
from stages.common.runtime import torch_threads
from stages.common.cli import StageResult, compose_stage, register_schema, stage_main
from stages.common.corpus import Docstring, as_conversation, file_docstrings, stdlib_source_files, write_jsonl
from stages.common.errors import RegraftError
from stages.common.toy import assistant_loss, fit_causal_lm, generate_answers, pack_chats, tiny_llama, train_tokenizer
from stages.common.vocab import VocabMap
from stages.compare import compare_vocab_maps
from stages.vocab_map import build_vocab_map, count_assistant_tokens


@dataclass
class WorldConfig:
    out: str = MISSING
    seed: int = 0
    max_docs: int = 6000  # stdlib docstrings to use (about 5,500 distinct ones exist), split a-m (A) / n-z (B)
    eval_docs: int = 64  # held-out chats per domain for the targets' eval loss
    tokenizer_vocab_size: int = 4096
    hidden_size: int = 128  # the targets' shape (the drafter copies width and heads)
    num_layers: int = 4
    num_heads: int = 4
    seq_len: int = 256  # target training rows: whole chats packed into this many tokens
    batch_size: int = 4  # rows per step: at equal compute, 4 x 256 beat 8 and 16 (eval loss 5.08 / 5.21 / 5.51)
    lr: float = 3e-3  # AdamW peak; warmup then cosine to lr/10, per target
    steps_a: int = 200  # target A on domain A
    steps_b: int = 100  # target B = target A further on domain B
    regen_prompts: int = 512  # domain-B prompts whose answers target B regenerates into data_b.jsonl
    regen_temperature: float = 0.8  # sampled, as SpecForge documents it; 0: greedy (loops on ~30 ids here)
    max_new_tokens: int = 64  # per regenerated answer (cut answers are kept, as in EAGLE-3 data)
    gen_batch_size: int = 64
    probe_prompts: int = 16  # held-out domain-B prompts in prompts_b.jsonl
    probe_multi_turn: int = 4  # of which this many have two user turns
    draft_vocab_size: int = 1024  # the source drafter's draft vocab, built from domain A
    drafter_steps: int = 60  # finetune (init=scratch) of drafter_a on target A / data_a
    drafter_ttt_steps: int = 3
    drafter_lr: float = 3e-3
    drafter_batch_size: int = 8
    drafter_max_length: int = 96
    threads: int = 1  # torch CPU threads while building (0: torch's default); see conf/world/default.yaml


register_schema("world", WorldConfig)

# A seconds-scale world for tests and the pipeline's end-to-end test (about 15 s on 2 CPU cores).
TINY_WORLD_OVERRIDES = [
    "max_docs=240", "eval_docs=8", "tokenizer_vocab_size=1024", "hidden_size=32", "num_layers=2", "num_heads=2",
    "seq_len=128", "batch_size=8", "steps_a=30", "steps_b=20", "regen_prompts=40", "max_new_tokens=24",
    "gen_batch_size=16", "probe_prompts=6", "probe_multi_turn=2", "draft_vocab_size=128", "drafter_steps=12",
    "drafter_batch_size=4", "drafter_max_length=64", "threads=1",
]


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


def chats(docs: list[Docstring]) -> list[list[dict]]:
    return [as_conversation(doc, index)["messages"] for index, doc in enumerate(docs)]


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


def train_drafter(cfg: DictConfig, root: Path, map_a: VocabMap, train_chats: int) -> dict[str, float]:
    """drafter_a: the finetune stage itself (init=scratch, in process) on target A and data_a with A's map."""
    from stages import finetune

    work = root / ".drafter_a"
    work.mkdir()
    torch.save({"d2t": map_a.d2t, "t2d": map_a.t2d}, work / "map_a.pt")
    per_epoch = max(1, (train_chats - max(1, round(0.02 * train_chats))) // cfg.drafter_batch_size)
    ft_cfg = compose_stage("finetune", [
        f"target={root / 'target_a'}", f"data={root / 'data_a.jsonl'}", f"vocab_map={work / 'map_a.pt'}",
        f"out={work / 'finetune'}", f"checkpoint_dir={work / 'checkpoints'}", "init=scratch", "spawn=inprocess",
        "resume=false", "checkpoint_every=1000000000", f"seed={cfg.seed}", f"ttt_steps={cfg.drafter_ttt_steps}",
        f"lr={cfg.drafter_lr}", f"max_steps={cfg.drafter_steps}", f"epochs={math.ceil(cfg.drafter_steps / per_epoch)}",
        f"micro_batch_size={cfg.drafter_batch_size}", f"max_length={cfg.drafter_max_length}", "val_fraction=0.02"])
    result = finetune.run(ft_cfg)
    shutil.move(str(result.out / "drafter"), root / "drafter_a")
    shutil.rmtree(work)
    keep = ("val_loss", "val_full_acc_0", "val_sim_accept_len")
    return {f"drafter_{key}": result.metrics[key] for key in keep if key in result.metrics}


def train_target(model, tokenizer, docs: list[Docstring], cfg: DictConfig, steps: int, seed: int, name: str) -> float:
    losses = fit_causal_lm(model, pack_chats(tokenizer, chats(docs), cfg.seq_len), steps, cfg.lr, cfg.batch_size,
                           seed, desc=f"world: {name}")
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def run(cfg: DictConfig) -> StageResult:
    with torch_threads(cfg.threads):
        return build(cfg)


def build(cfg: DictConfig) -> StageResult:
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
            model_b = copy.deepcopy(model_a)
            metrics["target_b_train_loss"] = train_target(model_b, tokenizer, domains.train_b, cfg, cfg.steps_b,
                                                          cfg.seed + 1, "target_b")
            model_b.save_pretrained(root / "target_b")
            tokenizer.save_pretrained(root / "target_b")
        with phase("eval"):
            for model, name in ((model_a, "a"), (model_b, "b")):
                for docs, domain in ((domains.eval_a, "a"), (domains.eval_b, "b")):
                    metrics[f"target_{name}_eval_loss_{domain}"] = assistant_loss(model, tokenizer, chats(docs),
                                                                                  cfg.seq_len)
        with phase("regenerate"):
            prompts = [c[:1] for c in chats(domains.train_b)][: cfg.regen_prompts]
            answers = generate_answers(model_b, tokenizer, prompts, cfg.max_new_tokens, cfg.gen_batch_size,
                                       cfg.regen_temperature, cfg.seed, desc="world: regenerate data_b")
            write_jsonl([{"messages": p + [{"role": "assistant", "content": text}]}
                         for p, text in zip(prompts, answers.texts)], root / "data_b.jsonl")
            probes = probe_rows(domains.probes, cfg.probe_prompts, cfg.probe_multi_turn)
            write_jsonl(probes, root / "prompts_b.jsonl")
            greedy = generate_answers(model_b, tokenizer, [row["messages"][:1] for row in probes], cfg.max_new_tokens,
                                      cfg.gen_batch_size, desc="world: greedy on prompts_b")
            metrics.update(target_b_greedy_top1=greedy.mean_top1, greedy_distinct_ids=greedy.distinct_ids,
                           regen_tokens=answers.tokens, regen_distinct_ids=answers.distinct_ids,
                           regen_unfinished=answers.finished.count(False))
        with phase("drafter_a"):
            map_a = vocab_map_of(tokenizer, root / "data_a.jsonl", cfg.draft_vocab_size)
            metrics.update(train_drafter(cfg, root, map_a, len(domains.train_a)))
            comparison = compare_vocab_maps(map_a, vocab_map_of(tokenizer, root / "data_b.jsonl",
                                                                cfg.draft_vocab_size))
            metrics.update(maps_shared_ids=comparison.shared_ids, maps_positions_agree=comparison.positions_agree)
        metrics.update(docs_a=len(domains.train_a) + len(domains.eval_a), docs_b=len(domains.train_b) +
                       len(domains.eval_b) + len(domains.probes), data_a_chats=len(domains.train_a),
                       data_b_chats=len(prompts), probe_prompts=cfg.probe_prompts, vocab_size=len(tokenizer))
        metrics.update({f"seconds_{name}": seconds for name, seconds in phase.seconds.items()})
        metrics["seconds_total"] = round(time.perf_counter() - started, 2)
        headline = (f"target loss A {metrics['target_a_eval_loss_a']:.2f}, B {metrics['target_b_eval_loss_b']:.2f}; "
                    f"drafter_a full_acc_0 {metrics.get('drafter_val_full_acc_0', float('nan')):.3f}, "
                    f"sim_accept_len {metrics.get('drafter_val_sim_accept_len', float('nan')):.2f}; maps A/B: "
                    f"{comparison.positions_agree} of {cfg.draft_vocab_size} positions agree, "
                    f"{comparison.shared_ids} ids shared")
        staged.update(metrics=metrics, headline=headline)
    return StageResult(Path(cfg.out), metrics, headline)


def vocab_map_of(tokenizer, data: Path, draft_vocab_size: int) -> VocabMap:
    tally = count_assistant_tokens(tokenizer, read_conversations(data), len(tokenizer), 256)
    return build_vocab_map(tally.counts, draft_vocab_size, data.name)


if __name__ == "__main__":
    raise SystemExit(stage_main("world", run))
