"""probe stage: accept_len and tok/s of a drafter on a target. The pipeline runs it as three nodes with the same
settings: `probe` (phase 0, the source drafter as it is), `evaluate` (phase 1, the fine-tuned drafter) and
`baseline_evaluate` (the from-scratch one), so the phases are one measurement of different drafters.

In: `target` (an HF model folder), `drafter` (a checkpoint in either layout, or a finetune output holding
`drafter/`), `eval_sets` (each a name and `builtin` or a JSONL of chats whose user turns are asked one after
another): each set is measured (`num_prompts` conversations of it) and reported on its own, `accept_len/<set>`,
beside the aggregate over all of them (`accept_len`: their emitted tokens over their target forwards, so each set
weighs by its completed tokens).
Backends:
- `hf` runs greedy speculative decoding here and checks every answer against plain greedy decoding (a mismatch
  stops the stage with the conversation, turn and token).
- `vllm` serves the target with the drafter on vLLM (offline engine in the engine venv, `make venv-vllm`), the
  drafter rewritten as vLLM reads it (`served_drafter/`: speculators layout, input-of-layer aux ids), turn by turn,
  greedy; then the same prompts through vLLM without speculation and through the hf target, and every answer must
  equal both (lossless). Reports vLLM's own `1 + accepted / drafts` beside regraft's emitted / target forwards,
  and per-position acceptance from vLLM's `num_accepted_tokens_per_pos`.
- `sglang` starts (or uses) an SGLang server and reads `completion_tokens / spec_verify_ct` from its `meta_info`.
Out: `per_prompt.csv`, `report.json`, `acceptance.png` (hf, vllm), `engine.log` (vllm),
`server.log` (sglang) and `manifest.json`.

Three accept lengths (one set of prompts, a drafter that never hits gives 1.0 in each):
- `accept_len`: emitted tokens / target forwards, the prefill counted, pooled over every turn (regraft's headline,
  all backends; sglang: its `completion_tokens / spec_verify_ct`).
- `accept_len_per_request`: the mean over turns of each turn's own tokens / forwards, what a benchmark averaging
  per-request figures reports; it can rank two drafters unlike the pooled one (docs/engines.md says who reports which).
- `accept_len_vllm` (vllm only): `1 + accepted / drafts`, vLLM's, which leaves the prefill out (higher on short
  answers).

    python -m stages.probe target=DIR drafter=DIR out=DIR [backend=vllm|sglang] [num_steps=3] \
        ['eval_sets=[{name: chat, path: chats.jsonl}, {name: code, path: code.jsonl}]']
"""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from stages.common.contract.artifacts import StagedOutput, staged_output
from stages.common.data.chat import load_tokenizer
from stages.common.data.chat_prompts import prompt_ids, stop_ids
from stages.common.contract.stage import StageResult, stage_main
from stages.common.drafter.acceptance import (WARM_UP, accept_length, accept_length_per_request, asked_turns,
                                              chat_renderer, load_eval_sets, per_set)
from stages.common.drafter.checkpoint import DrafterCheckpoint
from stages.common.drafter.config import check_drafter_fits_target, parse_config, target_config
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.engines.sglang_backend import aux_convention_warning, run_sglang
from stages.common.drafter.spec_decode import SpeculativeDecoder, greedy_generate
from stages.common.drafter.target import TargetModel
from stages.common.engines.vllm_engine import VllmEngine, served_drafter
from stages.schemas.probe import Backend, check_probe


def drafter_dir(path: str | Path) -> Path:
    """A finetune stage output holds its export in drafter/; anything else is the checkpoint itself."""
    path = Path(path)
    return path / "drafter" if (path / "drafter" / "config.json").exists() else path


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure_hf(cfg: DictConfig, conversations: list[list[str]], tokenizer, drafter_path: Path
               ) -> tuple[list[dict], list[int], float]:
    """Every turn decoded twice, speculatively and plainly; returns per-turn rows, accepted drafts per verify and
    the seconds the drafter and target took to load."""
    dtype, start = getattr(torch, cfg.dtype), time.perf_counter()
    checkpoint = DrafterCheckpoint.open(drafter_path)
    check_drafter_fits_target(checkpoint.config, target_config(cfg.target), drafter_path, cfg.target)
    drafter = Eagle3Drafter.from_checkpoint(checkpoint, dtype=dtype)
    target = TargetModel.load(cfg.target, drafter.config.aux_layer_ids, drafter.config.aux_convention, dtype,
                              cfg.trust_remote_code)
    load_seconds = time.perf_counter() - start
    decoder, stops = SpeculativeDecoder(target, drafter, cfg.num_steps), stop_ids(tokenizer, Path(cfg.target))
    decoder.generate(prompt_ids(tokenizer, WARM_UP), 4, stops)  # one-off allocation costs, kept out of tok/s
    rows, accepted = [], []
    for c, t, prompt, messages in asked_turns(conversations, tokenizer, "probe"):
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
    return rows, accepted, load_seconds


def measure_sglang(cfg: DictConfig, conversations: list[list[str]], tokenizer, drafter_path: Path,
                   log_path: Path) -> list[dict]:
    return run_sglang(cfg.sglang, target=cfg.target, drafter=str(drafter_path), conversations=conversations,
                      render=chat_renderer(tokenizer), max_new_tokens=cfg.max_new_tokens, num_steps=cfg.num_steps,
                      topk=cfg.topk, num_draft_tokens=cfg.num_draft_tokens, log_path=log_path)


def counter_delta(after: dict, before: dict, name: str) -> int | list[int]:
    key = f"vllm:spec_decode_{name}"
    if isinstance(after.get(key), list):
        previous = before.get(key) or [0] * len(after[key])
        return [a - b for a, b in zip(after[key], previous)]
    return after.get(key, 0) - before.get(key, 0)


def ask_turn_by_turn(engine: VllmEngine, conversations: list[list[str]], tokenizer, cfg: DictConfig,
                     stops: list[int]) -> list[dict]:
    """Each turn as its own greedy request (batch 1, as the hf backend and SGLang's benchmarks ask), on the
    history of the engine's own answers; vLLM's counters read before and after give each turn's drafts."""
    rows = []
    counters = engine.generate([prompt_ids(tokenizer, WARM_UP)], 4, stop_token_ids=stops)["counters"]
    for c, t, prompt, messages in asked_turns(conversations, tokenizer, "probe (vllm)"):
        answer = engine.generate([prompt], cfg.max_new_tokens, stop_token_ids=stops)
        tokens, before, counters = answer["outputs"][0], counters, answer["counters"]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        drafts = counter_delta(counters, before, "num_drafts")
        rows.append({"conversation": c, "turn": t, "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                     "verify_steps": 1 + drafts, "accept_len": round(len(tokens) / (1 + drafts), 4),
                     "drafts": drafts, "accepted": counter_delta(counters, before, "num_accepted_tokens"),
                     "accepted_per_pos": counter_delta(counters, before, "num_accepted_tokens_per_pos"),
                     "seconds": round(answer["seconds"], 4), "text": text, "prompt": prompt, "tokens": tokens})
    return rows


def check_same_tokens(rows: list[dict], reference: list[list[int]], against: str, out: str) -> None:
    """Every answer equals the reference decoding's, else one error naming the turn, token index and prompt."""
    for row, expected in zip(rows, reference):
        if row["tokens"] != expected:
            at = first_difference(row["tokens"], expected)
            raise RegraftError(out, f"not lossless: vLLM with speculation left {against} at token {at} of "
                               f"conversation {row['conversation']} turn {row['turn']} (prompt ends "
                               f"{row['prompt'][-8:]}, speculative {row['tokens'][at:at + 4]} vs "
                               f"{expected[at:at + 4]})", "report this with the target, drafter and engine versions")


def plain_vllm(engine: VllmEngine, cfg: DictConfig, prompts: list[list[int]], stops: list[int]) -> list[dict]:
    """The same prompts through vLLM without speculation, one by one: each answer's token ids and seconds."""
    engine.start(cfg.target, dtype=cfg.dtype, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    engine.generate(prompts[:1], 4, stop_token_ids=stops)
    return [engine.generate([prompt], cfg.max_new_tokens, stop_token_ids=stops) for prompt in prompts]


def hf_target(cfg: DictConfig, drafter_path: Path, dtype: str) -> TargetModel:
    config = DrafterCheckpoint.open(drafter_path).config
    return TargetModel.load(cfg.target, config.aux_layer_ids, config.aux_convention, getattr(torch, dtype),
                            cfg.trust_remote_code)


def check_against_hf(cfg: DictConfig, rows: list[dict], drafter_path: Path, stops: list[int]) -> dict[str, float]:
    """Every speculative answer held against the hf target's greedy decoding in the engine's dtype. Two
    implementations of one model agree exactly in float32; in a lower precision their greedy paths may part where
    two tokens' logits are closer than that precision's rounding, which is no loss of the speculation (the engine's
    own plain greedy is held exactly). A turn that parts there counts as a rounding tie and is compared no further;
    any other difference is an error. Returns the counts for the manifest."""
    target = hf_target(cfg, drafter_path, cfg.dtype)
    exact, ties, widest = None, 0, 0.0
    for row in rows:
        expected = greedy_generate(target, row["prompt"], cfg.max_new_tokens, set(stops)).tokens
        if row["tokens"] == expected:
            continue
        at = first_difference(row["tokens"], expected)
        if cfg.dtype != "float32" and at < min(len(row["tokens"]), len(expected)):
            exact = exact or hf_target(cfg, drafter_path, "float32")
            margin, rounding = tie_margin(target, exact, row["prompt"] + expected[:at], expected[at], row["tokens"][at])
            if margin <= rounding:
                ties, widest = ties + 1, max(widest, margin)
                continue
        check_same_tokens([row], [expected], "the hf target's greedy decoding", cfg.out)
    return {"hf_turns_equal": len(rows) - ties, "hf_turns_rounding_ties": ties, "hf_tie_widest_margin": widest}


def tie_margin(target: TargetModel, exact: TargetModel, context: list[int], hf_token: int, engine_token: int
               ) -> tuple[float, float]:
    """How far float32 logits after `context` put the hf token above the engine's, and how far the lower
    precision's logits there stray from float32's (the largest difference over the vocab): its rounding, measured."""
    with torch.no_grad():
        low = target.features(torch.tensor([context])).logits[0, -1].float()
        high = exact.features(torch.tensor([context])).logits[0, -1].float()
    return float(high[hf_token] - high[engine_token]), float((low - high).abs().max())


def measure_vllm(cfg: DictConfig, conversations: list[list[str]], tokenizer, drafter_path: Path,
                 staged: StagedOutput) -> tuple[list[dict], dict[str, float]]:
    """Speculative answers from vLLM, held against vLLM's plain greedy and (check_hf) the hf target's; the engine's
    versions go into the manifest."""
    out = staged.path
    served = served_drafter(drafter_path, out / "served_drafter", cfg.target)
    stops = sorted(stop_ids(tokenizer, Path(cfg.target)))
    speculative = {"method": "eagle3", "model": str(served), "num_speculative_tokens": cfg.num_steps}
    with VllmEngine(cfg.vllm, out / "engine.log") as engine:
        startup = engine.start(cfg.target, dtype=cfg.dtype, speculative=speculative, seed=cfg.seed,
                               trust_remote_code=cfg.trust_remote_code)
        staged.update(**engine.provenance())
        rows = ask_turn_by_turn(engine, conversations, tokenizer, cfg, stops)
        prompts = [row["prompt"] for row in rows]
        plain = plain_vllm(engine, cfg, prompts, stops)
    check_same_tokens(rows, [answer["outputs"][0] for answer in plain], "vLLM's plain greedy decoding", cfg.out)
    against_hf = check_against_hf(cfg, rows, drafter_path, stops) if cfg.check_hf else {}
    for row, answer in zip(rows, plain):
        row["plain_seconds"] = round(answer["seconds"], 4)
    drafts = sum(row["drafts"] for row in rows)
    per_position = [sum(row["accepted_per_pos"][i] for row in rows) for i in range(cfg.num_steps)]
    extra = {"accept_len_vllm": 1 + sum(row["accepted"] for row in rows) / max(drafts, 1),
             "import_seconds": engine.import_seconds, "startup_seconds": startup,
             "plain_startup_seconds": engine.startup_seconds, "start_wait_seconds": engine.waited_to_start_s,
             **acceptance(per_position, drafts), **against_hf}
    for row in rows:
        del row["prompt"], row["tokens"], row["accepted_per_pos"]
    return rows, extra


def acceptance(per_position: list[int], drafts: int) -> dict[str, float]:
    """Per draft position: how many drafts had it accepted (counts, as vLLM's `num_accepted_tokens_per_pos`) and
    the share of drafts."""
    metrics: dict[str, float] = {"drafts": drafts}
    for position, count in enumerate(per_position):
        metrics[f"accepted_at_{position + 1}"] = count
        metrics[f"accept_rate_{position + 1}"] = count / max(drafts, 1)
    return metrics


def summarise(rows: list[dict], extra: dict[str, float], num_steps: int, backend: Backend) -> dict[str, float]:
    tokens = sum(row["completion_tokens"] for row in rows)
    seconds = sum(row["seconds"] for row in rows)
    metrics = {"accept_len": accept_length(rows), "accept_len_per_request": accept_length_per_request(rows),
               "tok_s": tokens / seconds if seconds else float("nan"),
               "completion_tokens": tokens, "turns": len(rows), "num_steps": num_steps, **extra}
    if backend is not Backend.sglang:
        plain_seconds = sum(row["plain_seconds"] for row in rows)
        metrics["plain_tok_s"] = tokens / plain_seconds
        metrics["speedup"] = plain_seconds / seconds
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
    _, parsed = parse_config(drafter_config, drafter_path / "config.json")  # every backend: refused before an engine
    # starts
    tokenizer = load_tokenizer(cfg.target, cfg.trust_remote_code)
    conversations, sets = load_eval_sets(cfg.eval_sets, cfg.num_prompts, cfg.seed)
    # the vllm backend serves a converted copy in vLLM's convention, so only SGLang can read the ids wrong
    warning = aux_convention_warning(drafter_config, "sglang") if backend is Backend.sglang else None
    if warning:
        print(f"warning: {warning}")
    with staged_output(cfg.out, "probe", cfg) as staged:
        extra: dict[str, float] = {}
        if backend is Backend.hf:
            rows, accepted, load_seconds = measure_hf(cfg, conversations, tokenizer, drafter_path)
            extra = {**acceptance([sum(a > i for a in accepted) for i in range(cfg.num_steps)], len(accepted)),
                     "load_seconds": load_seconds}
        elif backend is Backend.vllm:
            rows, extra = measure_vllm(cfg, conversations, tokenizer, drafter_path, staged)
        else:
            rows = measure_sglang(cfg, conversations, tokenizer, drafter_path, staged.path / "server.log")
        metrics = {**summarise(rows, extra, cfg.num_steps, backend), **per_set(rows, sets)}
        write_rows(rows, staged.path / "per_prompt.csv")
        if backend is not Backend.sglang:
            plot_acceptance(metrics, cfg.num_steps, staged.path / "acceptance.png")
        headline = f"{parsed.describe()}: accept_len {metrics['accept_len']:.2f} at {cfg.num_steps} draft steps"
        if backend is Backend.vllm:
            headline += f" (vLLM's 1+accepted/drafts: {metrics['accept_len_vllm']:.2f})"
        if len(cfg.eval_sets) > 1:
            headline += " (" + ", ".join(f"{entry.name} {metrics[f'accept_len/{entry.name}']:.2f}"
                                         for entry in cfg.eval_sets) + ")"
        headline += f", {metrics['tok_s']:.0f} tok/s"
        if backend is not Backend.sglang:
            against = " vs vLLM plain" + (" and hf" if cfg.check_hf else "") if backend is Backend.vllm else ""
            headline += (f" vs {metrics['plain_tok_s']:.0f} plain ({metrics['speedup']:.2f}x), lossless{against} "
                         f"on {len(rows)} turns")
        (staged.path / "report.json").write_text(json.dumps(
            {"metrics": metrics, "drafter": str(drafter_path), "aux_warning": warning}, indent=2))
        staged.update(metrics=metrics, headline=headline)
    return StageResult(Path(cfg.out), metrics, headline)


if __name__ == "__main__":
    raise SystemExit(stage_main("probe", run))
