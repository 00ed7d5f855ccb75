"""probe stage: accept_len and tok/s of a drafter on a target. The pipeline runs it as three nodes with the same
settings: `probe` (phase 0, the source drafter as it is), `evaluate` (phase 1, the fine-tuned drafter) and
`baseline_evaluate` (the from-scratch one), so the phases are one measurement of different drafters.

In: `target` (an HF model folder), `drafter` (a checkpoint in either layout, or a finetune output holding
`drafter/`), `prompts` (`builtin` or a JSONL of chats whose user turns are asked one after another).
Backends: `hf` runs greedy speculative decoding here and checks every answer against plain greedy decoding
(a mismatch stops the stage with the conversation, turn and token); `sglang` starts (or uses) an SGLang server and reads
`completion_tokens / spec_verify_ct` from its `meta_info`.
Out: `per_prompt.csv`, `report.json`, `acceptance.png` (hf), `server.log` (sglang) and `manifest.json`.

    python -m stages.probe target=DIR drafter=DIR out=DIR [backend=sglang] [num_steps=3] [prompts=chats.jsonl]
"""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch
from omegaconf import MISSING, DictConfig
from tqdm import tqdm

from stages.common.artifacts import staged_output
from stages.common.chat import load_tokenizer, read_conversations
from stages.common.stage import StageResult, register_schema, setting, stage_main
from stages.common.checkpoint import DrafterCheckpoint
from stages.common.drafter_config import check_drafter_fits_target, target_config
from stages.common.eagle3 import Eagle3Drafter
from stages.common.errors import RegraftError
from stages.common.sglang_backend import SglangConfig, accept_length, aux_convention_warning, run_sglang
from stages.common.spec_decode import SpeculativeDecoder, greedy_generate
from stages.common.target import TargetModel

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


class Backend(str, Enum):
    hf = "hf"  # local transformers target, greedy speculative decoding checked against plain greedy
    sglang = "sglang"  # a real SGLang server (started here, or `sglang.server_url`)


@dataclass
class ProbeConfig:
    target: str = MISSING  # HF model folder of the target (verifier)
    drafter: str = MISSING  # drafter checkpoint folder, or a finetune output folder holding drafter/
    out: str = MISSING
    backend: Backend = Backend.hf  # hf: local greedy speculative decoding, checked lossless | sglang: a server
    prompts: str = "builtin"  # builtin | a JSONL of {"messages": [...]} (user turns are the prompts)
    num_prompts: int = setting(8, at_least=1)  # conversations, picked by a seeded shuffle
    max_new_tokens: int = setting(64, at_least=1)
    seed: int = 0
    num_steps: int = setting(3, at_least=1)  # draft tokens per verify step (chain drafting)
    topk: int = setting(1, at_least=1)  # sglang only; the hf backend drafts a chain
    num_draft_tokens: int = setting(4, at_least=2)  # sglang: tokens verified per step (num_steps + 1 for a chain)
    dtype: str = "float32"  # hf: target and drafter dtype
    trust_remote_code: bool = False  # run the code in the target's folder (Kimi's tokenizer and model need it)
    sglang: SglangConfig = field(default_factory=SglangConfig)


def check_probe(cfg: DictConfig, where: str) -> None:
    prefix = f"{where}." if where else ""
    if Backend(cfg.backend) is Backend.hf and cfg.topk != 1:
        raise RegraftError(f"{prefix}topk={cfg.topk}", "the hf backend drafts a chain (topk 1)",
                           f"set {prefix}topk=1, or {prefix}backend=sglang")
    if not isinstance(getattr(torch, cfg.dtype, None), torch.dtype):
        raise RegraftError(f"{prefix}dtype={cfg.dtype}", "is not a torch dtype",
                           f"set {prefix}dtype= to float32, bfloat16 or float16")


register_schema("probe", ProbeConfig, check=check_probe)


def drafter_dir(path: str | Path) -> Path:
    """A finetune stage output holds its export in drafter/; anything else is the checkpoint itself."""
    path = Path(path)
    return path / "drafter" if (path / "drafter" / "config.json").exists() else path


def load_prompts(source: str, count: int, seed: int) -> list[list[str]]:
    """Conversations as lists of user turns, picked by a seeded shuffle."""
    if source == "builtin":
        conversations = [list(turns) for turns in BUILTIN_PROMPTS]
    else:
        conversations = [[m["content"] for m in messages if m["role"] == "user"]
                         for messages in read_conversations(Path(source))]
        conversations = [turns for turns in conversations if turns]
    if not conversations:
        raise RegraftError(source, "no user turns to ask", "give prompts= chats with at least one user message")
    random.Random(seed).shuffle(conversations)
    return conversations[:count]


def chat_renderer(tokenizer):
    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    return render


def stop_ids(tokenizer, target_dir: Path) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = json.loads((target_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure_hf(cfg: DictConfig, conversations: list[list[str]], tokenizer, drafter_path: Path) -> tuple[list[dict], list[int]]:
    """Every turn decoded twice, speculatively and plainly; returns per-turn rows and accepted drafts per verify."""
    dtype = getattr(torch, cfg.dtype)
    checkpoint = DrafterCheckpoint.open(drafter_path)
    check_drafter_fits_target(checkpoint.config, target_config(cfg.target), drafter_path, cfg.target)
    drafter = Eagle3Drafter.from_checkpoint(checkpoint, dtype=dtype)
    target = TargetModel.load(cfg.target, drafter.config.aux_layer_ids, drafter.config.aux_convention, dtype,
                              cfg.trust_remote_code)
    decoder, render, stops = SpeculativeDecoder(target, drafter, cfg.num_steps), chat_renderer(tokenizer), \
        stop_ids(tokenizer, Path(cfg.target))
    warm_up = tokenizer.encode(render([{"role": "user", "content": "hi"}]), add_special_tokens=False)
    decoder.generate(warm_up, 4, stops)  # first calls pay one-off allocation costs; keep them out of tok/s
    rows, accepted = [], []
    turns = [(c, t) for c, conversation in enumerate(conversations) for t in range(len(conversation))]
    messages: list[dict] = []
    for c, t in tqdm(turns, desc="probe", unit="turn"):
        messages = [] if t == 0 else messages
        messages.append({"role": "user", "content": conversations[c][t]})
        prompt = tokenizer.encode(render(messages), add_special_tokens=False)
        plain = greedy_generate(target, prompt, cfg.max_new_tokens, stops)
        spec = decoder.generate(prompt, cfg.max_new_tokens, stops)
        if spec.tokens != plain.tokens:
            at = first_difference(spec.tokens, plain.tokens)
            raise RegraftError(cfg.out, f"not lossless: speculative decoding left plain greedy at token {at} of "
                               f"conversation {c} turn {t}", "report this with the target and drafter: it is a bug")
        answer = tokenizer.decode(spec.tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        accepted += spec.accepted
        rows.append({"conversation": c, "turn": t, "prompt_tokens": len(prompt),
                     "completion_tokens": len(spec.tokens), "verify_steps": spec.target_forwards,
                     "accept_len": round(spec.accept_len, 4), "seconds": round(spec.seconds, 4),
                     "plain_seconds": round(plain.seconds, 4), "text": answer})
    return rows, accepted


def measure_sglang(cfg: DictConfig, conversations: list[list[str]], tokenizer, drafter_path: Path,
                   log_path: Path) -> list[dict]:
    return run_sglang(cfg.sglang, target=cfg.target, drafter=str(drafter_path), conversations=conversations,
                      render=chat_renderer(tokenizer), max_new_tokens=cfg.max_new_tokens, num_steps=cfg.num_steps,
                      topk=cfg.topk, num_draft_tokens=cfg.num_draft_tokens, log_path=log_path)


def summarise(rows: list[dict], accepted: list[int], num_steps: int, backend: Backend) -> dict[str, float]:
    tokens = sum(row["completion_tokens"] for row in rows)
    seconds = sum(row["seconds"] for row in rows)
    metrics = {"accept_len": accept_length(rows), "tok_s": tokens / seconds if seconds else float("nan"),
               "completion_tokens": tokens, "turns": len(rows), "num_steps": num_steps}
    if backend is Backend.hf:
        plain_seconds = sum(row["plain_seconds"] for row in rows)
        metrics.update(plain_tok_s=tokens / plain_seconds, speedup=plain_seconds / seconds)
        for position in range(num_steps):
            rate = sum(a > position for a in accepted) / max(len(accepted), 1)
            metrics[f"accept_rate_{position + 1}"] = rate
    return metrics


def plot_acceptance(metrics: dict[str, float], num_steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [metrics[f"accept_rate_{i + 1}"] for i in range(num_steps)]
    figure, axes = plt.subplots(figsize=(5, 3.2))
    axes.bar(range(1, num_steps + 1), rates, color="tab:blue")
    axes.set(xlabel="draft position", ylabel="accepted share of verify steps", ylim=(0, 1),
             title=f"accept_len {metrics['accept_len']:.2f}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_rows(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def run(cfg: DictConfig) -> StageResult:
    check_probe(cfg, "")
    backend, drafter_path = Backend(cfg.backend), drafter_dir(cfg.drafter)
    drafter_config = json.loads((drafter_path / "config.json").read_text()) if (drafter_path / "config.json").exists() \
        else None
    if drafter_config is None:
        raise RegraftError(drafter_path, "no drafter config.json", "give drafter= a drafter checkpoint folder")
    tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
    conversations = load_prompts(cfg.prompts, cfg.num_prompts, cfg.seed)
    warning = aux_convention_warning(drafter_config, "sglang") if backend is Backend.sglang else None
    if warning:
        print(f"warning: {warning}")
    with staged_output(cfg.out, "probe", cfg) as staged:
        accepted: list[int] = []
        if backend is Backend.hf:
            rows, accepted = measure_hf(cfg, conversations, tokenizer, drafter_path)
        else:
            rows = measure_sglang(cfg, conversations, tokenizer, drafter_path, staged.path / "server.log")
        metrics = summarise(rows, accepted, cfg.num_steps, backend)
        write_rows(rows, staged.path / "per_prompt.csv")
        if backend is Backend.hf:
            plot_acceptance(metrics, cfg.num_steps, staged.path / "acceptance.png")
        headline = f"accept_len {metrics['accept_len']:.2f} at {cfg.num_steps} draft steps, " \
                   f"{metrics['tok_s']:.0f} tok/s"
        if backend is Backend.hf:
            headline += f" vs {metrics['plain_tok_s']:.0f} plain ({metrics['speedup']:.2f}x), lossless on {len(rows)} turns"
        (staged.path / "report.json").write_text(json.dumps(
            {"metrics": metrics, "drafter": str(drafter_path), "aux_warning": warning}, indent=2))
        staged.update(metrics=metrics, headline=headline)
    return StageResult(Path(cfg.out), metrics, headline)


if __name__ == "__main__":
    raise SystemExit(stage_main("probe", run))
