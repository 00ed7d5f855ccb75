"""The dress rehearsal of `experiment=kimi_k25`: the real experiment file, end to end, on a miniature with the real
structure, so that the first GPU-day is not where a format mismatch is found.

    .venv/bin/python bench/rehearsal.py [--work DIR]        # build, serve, run; print the stage table
    .venv/bin/python bench/rehearsal.py --write             # and write it into docs/real-models.md (block `rehearsal`)
    .venv/bin/python bench/rehearsal.py --again [--write]   # the last rehearsal's table again (WORK/rehearsal.json)

What it runs (about ten minutes on 2 cores; needs .venv-vllm, `make venv-vllm`):
1. a small built-in world, for its tokenizer, its training prompts and its two held-out sets (prose and code);
2. the miniature Kimi-K2.5 (tests/kimi_miniature.py: the multimodal wrapper, a DeepSeek-V3 language model with MLA
   and MoE, the release's weight names, the tiktoken stand-in tokenizer) and a source drafter in the Kimi line's MLA
   format;
3. a real `vllm serve` OpenAI server on the miniature, held against transformers: the same greedy tokens, and the
   log-probabilities of those tokens, from both;
4. `regraft experiment=kimi_k25` against that server, with only the overrides of `OVERRIDES` below: paths, sizes,
   and the three settings this machine cannot take as written (each with its reason).

`run_rehearsal` is what tests/test_rehearsal.py runs too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.figures import code_commit  # noqa: E402

WORLD = ("max_docs=240", "eval_docs=8", "tokenizer_vocab_size=1024", "hidden_size=32", "num_layers=2", "num_heads=2",
         "seq_len=128", "batch_size=8", "steps_a=30", "steps_b=20", "regen_prompts=40", "max_new_tokens=24",
         "gen_batch_size=16", "probe_prompts=6", "probe_multi_turn=2")
# Sizes: the miniature's, the machine's (2 cores, one process per engine, 1 GiB of KV cache).
SIZES = ("regenerate.max_tokens=32", "regenerate.concurrency=8", "vocab_map.draft_vocab_size=256",
         "probe.num_prompts=8", "probe.max_new_tokens=32", "features.batch_size=8",
         "features.vllm.tensor_parallel_size=1", "features.vllm.kvcache_space_gib=1", "features.vllm.threads=1",
         "finetune.max_length=128", "finetune.nproc=2", "finetune.val_fraction=0.2", "finetune.checkpoint_every=50")
# The settings of experiment=kimi_k25 this machine cannot run as written, and why: everything else is as written.
MACHINE = {
    "probe.backend=hf": "no SGLang here, and vLLM 0.32's CPU build, speculating on this MLA target, leaves its own "
                        "plain greedy decoding even in float32 (this rehearsal found it; tests/test_probe_vllm.py "
                        "MLA_ON_VLLM): the probes run on regraft's hf path, which holds every answer token for "
                        "token against the target's plain greedy",
    "probe.dtype=float32": "in bf16 the hf path's verify forward (several positions) rounds unlike its decode forward "
                           "(one), and greedy paths part where two tokens nearly tie (this rehearsal found it); "
                           "float32 holds them token for token",
    "features.backend=hf": "vLLM 0.32's CPU rotary op misreads the views MLA attention passes it, so every state "
                           "its engine gives an MLA target is wrong (docs/families.md, 'Who computes MLA as DeepSeek "
                           "does'), and regraft refuses it: the features (and diagnose, which follows them) are read "
                           "through transformers",
    "launcher.node_gpus=null": "the experiment's node has 8 GPUs, this machine none: counted here, no stage holds one",
}
SERVER_TOKENS = 12  # greedy tokens per prompt in the server-vs-transformers check
# the miniature's training steps: after 60 its greedy answers were chat-template tokens in a loop, which its sampled
# (regenerated) answers never hold; after 300 (36 s) they are text, as a real target's are
TARGET_STEPS = 300


@dataclass
class Rehearsal:
    work: Path
    world: Path = field(init=False)
    target: Path = field(init=False)
    source: Path = field(init=False)

    def __post_init__(self) -> None:
        self.world, self.target, self.source = self.work / "world", self.work / "Kimi-K2.5", self.work / "source"

    def overrides(self, server_url: str) -> list[str]:
        sets = ", ".join(f"{{name: {name}, path: {self.world / f'prompts_b_{name}.jsonl'}}}" for name in ("prose", "code"))
        paths = [f"target.path={self.target}", f"source.path={self.source}",
                 f"data.train={self.world / 'data_b.jsonl'}", f"data.eval_sets=[{sets}]",
                 f"regenerate.server_url={server_url}", f"paths.outputs={self.work / 'outputs'}",
                 f"features.vllm.python={ROOT / '.venv-vllm/bin/python'}"]
        return ["experiment=kimi_k25", *paths, *SIZES, *MACHINE]


def build(rehearsal: Rehearsal) -> dict[str, float]:
    """The world, the miniature target and the source drafter (each skipped when already there); their seconds."""
    from tests import kimi_miniature

    seconds = {}
    started = time.perf_counter()
    if not (rehearsal.world / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "stages.world", f"out={rehearsal.world}", *WORLD], cwd=ROOT, check=True,
                       capture_output=True)
    seconds["world"] = time.perf_counter() - started
    started = time.perf_counter()
    if not (rehearsal.target / "config.json").exists():
        kimi_miniature.build_target(rehearsal.world / "tokenizer", rehearsal.world / "data_b.jsonl", rehearsal.target,
                                    steps=TARGET_STEPS)
    if not (rehearsal.source / "config.json").exists():
        kimi_miniature.build_source_drafter(rehearsal.target, rehearsal.source)
    seconds["miniature"] = time.perf_counter() - started
    return seconds


def vllm_server(rehearsal: Rehearsal):
    """`vllm serve` on the miniature from .venv-vllm (float32, eager), as a context manager yielding its URL."""
    from stages.common.contract.runtime import free_port
    from stages.common.engines.engine_process import ServerProcess
    from stages.common.engines.vllm_engine import VllmConfig, needs_reference_mla

    port = free_port("127.0.0.1")
    command = [str(ROOT / ".venv-vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(rehearsal.target), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
               "--host", "127.0.0.1", "--port", str(port), "--trust-remote-code"]
    if needs_reference_mla(VllmConfig(), rehearsal.target, "float32"):  # as regraft's own server_command asks
        command += ["--attention-backend", "CPU_MLA"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return ServerProcess("vLLM server", command, f"http://127.0.0.1:{port}", rehearsal.work / "server.log",
                         settings="vllm", startup_timeout_s=600, request_timeout_s=60, stop_grace_s=10, env=env)


def prompt_ids(rehearsal: Rehearsal, count: int) -> list[list[int]]:
    """The first `count` prose prompts, through the miniature's chat template (generation prompt on)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rehearsal.target, trust_remote_code=True)
    rows = [json.loads(line) for line in (rehearsal.world / "prompts_b_prose.jsonl").read_text().splitlines()]
    return [list(tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for row in rows[:count]]


def server_greedy(url: str, model: str, ids: list[int]) -> tuple[list[int], list[float]]:
    """The server's greedy continuation of `ids` and each chosen token's log-probability."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": SERVER_TOKENS, "temperature": 0,
                       "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        logprobs = json.loads(response.read())["choices"][0]["logprobs"]
    return [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]], logprobs["token_logprobs"]


def hf_greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (the full forward each step: no cache to differ) and its log-probabilities."""
    import torch

    tokens, logprobs, sequence = [], [], list(ids)
    with torch.no_grad():
        for _ in range(SERVER_TOKENS):
            log_p = torch.log_softmax(model(torch.tensor([sequence])).logits[0, -1].float(), dim=-1)
            token = int(log_p.argmax())
            tokens.append(token)
            logprobs.append(float(log_p[token]))
            sequence.append(token)
    return tokens, logprobs


def server_agreement(rehearsal: Rehearsal, url: str, count: int = 4) -> dict:
    """The server against transformers' own Kimi-K2.5 class on the same prompts: greedy tokens and log-probs."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(rehearsal.target, dtype=torch.float32).eval()
    equal, compared, worst = 0, 0, 0.0
    for ids in prompt_ids(rehearsal, count):
        served, served_lp = server_greedy(url, str(rehearsal.target), ids)
        reference, reference_lp = hf_greedy(model, ids)
        same = next((i for i, (a, b) in enumerate(zip(served, reference)) if a != b), len(reference))
        equal += same
        compared += len(reference)
        worst = max([worst, *(abs(a - b) for a, b in zip(served_lp[:same], reference_lp[:same]))])
    return {"prompts": count, "tokens": compared, "equal_tokens": equal, "max_logprob_diff": worst}


def regraft(rehearsal: Rehearsal, url: str) -> tuple[subprocess.CompletedProcess, Path | None]:
    """`regraft experiment=kimi_k25` with the rehearsal's overrides; its output and its run folder."""
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", *rehearsal.overrides(url)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    runs = [run for run in (rehearsal.work / "outputs" / "runs").glob("*/summary.json")
            if run.stat().st_mtime >= started - 1]
    return done, max(runs, key=lambda run: run.stat().st_mtime).parent if runs else None


def run_rehearsal(work: Path) -> dict:
    """Build, serve, check the server, run the experiment; everything the table and the test read."""
    rehearsal = Rehearsal(work)
    work.mkdir(parents=True, exist_ok=True)
    seconds = build(rehearsal)
    started = time.perf_counter()
    with vllm_server(rehearsal) as server:
        seconds["server_start"] = time.perf_counter() - started
        agreement = server_agreement(rehearsal, server.url)
        started = time.perf_counter()
        done, run = regraft(rehearsal, server.url)
        seconds["regraft"] = time.perf_counter() - started
    summary = json.loads((run / "summary.json").read_text()) if run else None
    result = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr, "run": str(run),
              "summary": summary, "agreement": agreement, "seconds": seconds, "overrides": rehearsal.overrides("URL"),
              "date": time.strftime("%Y-%m-%d"), "commit": code_commit()}
    (work / "rehearsal.json").write_text(json.dumps(result, indent=1))
    return result


def engine_of(node: str, config: dict) -> str:
    """Where a stage's model ran, from the run's resolved config."""
    if node == "regenerate":
        return "vllm serve (OpenAI API)"
    if node in ("features", "diagnose") and config[node]["backend"] == "vllm":
        return f"vllm ({config[node]['vllm_connector']} connector)"
    if node in ("features", "diagnose"):
        return config[node]["backend"]
    if node in ("probe", "evaluate", "baseline_evaluate"):
        return config["probe"]["backend"]
    if node in ("finetune", "baseline_finetune"):
        ds = config["finetune"]["deepspeed"]
        return f"DeepSpeed ZeRO-{ds['zero_stage']}{' bf16' if ds['bf16'] else ''}, {config['finetune']['nproc']} ranks"
    return "-"


def stage_rows(summary: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, stage in summary["stages"].items():
        state = "cached" if stage["hit"] else f"{stage['seconds']:.0f} s"
        rows.append((name, engine_of(name, summary["config"]), state, stage.get("headline") or ""))
    return rows


def table(result: dict) -> str:
    rows = [("stage", "ran on", "time", "result")] + stage_rows(result["summary"])
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows]
    agreement = result["agreement"]
    # the log-probs are compared where the tokens agree: with none equal there is nothing to compare
    compared = f"largest log-prob difference {agreement['max_logprob_diff']:.2e}" if agreement["equal_tokens"] \
        else "so no log-prob compared"
    lines += ["", f"vllm serve vs transformers (Kimi_K25ForConditionalGeneration, float32), {agreement['prompts']} "
              f"prompts x {SERVER_TOKENS} greedy tokens: {agreement['equal_tokens']} of {agreement['tokens']} tokens "
              f"equal, {compared}"]
    return "\n".join(lines)


def block(result: dict) -> str:
    seconds = result["seconds"]
    said = (f"Written by `bench/rehearsal.py --write` from its run of {result['date']} at commit `{result['commit']}`: "
            f"the world and the miniature built "
            f"in {seconds['world'] + seconds['miniature']:.0f} s, the server up in {seconds['server_start']:.0f} s, "
            f"`regraft experiment=kimi_k25` {seconds['regraft']:.0f} s on this machine. Its overrides besides paths "
            f"and sizes: " + "; ".join(f"`{key}` ({why})" for key, why in MACHINE.items()) + ".")
    return "```\n" + table(result) + "\n```\n\n" + "\n".join(textwrap.wrap(said, width=118)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "rehearsal")
    parser.add_argument("--write", action="store_true", help="write the table into docs/real-models.md")
    parser.add_argument("--again", action="store_true", help="the table of the last rehearsal in --work "
                        "(its rehearsal.json), without running it again")
    args = parser.parse_args()
    result = json.loads((args.work / "rehearsal.json").read_text()) if args.again else run_rehearsal(args.work)
    if result["returncode"] != 0 or result["summary"] is None:
        raise SystemExit(f"regraft experiment=kimi_k25 failed (exit {result['returncode']}):\n"
                         f"{result['stdout'][-3000:]}{result['stderr'][-3000:]}")
    print(table(result))
    if args.write:
        from bench.figures import write_blocks

        write_blocks({"rehearsal": block(result)})


if __name__ == "__main__":
    main()
