"""What each CPU reproducibility setting costs, and whether it changes the numbers (stages/common/contract/runtime.py).

    .venv/bin/python bench/cpu_settings.py              # every row, about 2 minutes on 2 cores
    .venv/bin/python bench/cpu_settings.py --write      # and into the cpu-settings block (docs/results.md)

Each row runs in a fresh interpreter (the settings are read at a process's first torch op) on 1 thread: the default
world's target (hidden 128, 4 layers, vocab 4,096) takes training steps on 4 x 256 tokens (AdamW, as
stages/world/toy.py::fit_causal_lm) and decodes 32 greedy tokens for 16 prompts. Times are CPU milliseconds per
call (process time, best of 3: less sensitive to other jobs than wall time); `weights` is a digest of the target
after the steps: rows with one digest compute the same numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = {  # name -> the environment the row runs under (besides the caller's, less these keys)
    "none (this CPU's own choice)": {},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "both, avx2 (kept)": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"},
    "both, default": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"},
    "both, avx2, deterministic algorithms": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2",
                                             "BENCH_DETERMINISTIC": "1"},
}
KNOBS = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "BENCH_DETERMINISTIC")


def one() -> dict:
    """In the row's interpreter: the timings and the weights' digest."""
    import hashlib
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.world.toy import assistant_token_loss

    torch.set_num_threads(1)
    if os.environ.get("BENCH_DETERMINISTIC"):
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=512, max_position_embeddings=1024,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 4096, (4, 256), generator=generator)
    labels = ids.clone()
    labels[:, :64] = -100
    prompts = torch.randint(5, 4096, (16, 40), generator=generator)

    def step() -> None:
        loss = assistant_token_loss(model, ids, labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    @torch.no_grad()
    def generate() -> None:
        model.eval()
        model.generate(prompts, max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)
        model.train()

    step()
    row = {}
    for name, call, count in (("train_step_ms", step, 8), ("generate_ms", generate, 2)):
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            for _ in range(count):
                call()
            best = min(best, (time.process_time() - start) / count * 1000)
        row[name] = round(best, 1)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    row.update(weights=digest.hexdigest()[:12], capability=torch._C._get_cpu_capability())
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", "--readme", action="store_true",
                        help="write the table into its figures block (README.md or docs/, wherever it stands)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one()))
        return 0
    base = {key: value for key, value in os.environ.items() if key not in KNOBS}
    results = {}
    for name, env in ROWS.items():
        done = subprocess.run([sys.executable, __file__, "--one"], cwd=ROOT, capture_output=True, text=True,
                              env={**base, **env, "PYTHONPATH": str(ROOT)}, check=True)
        results[name] = json.loads(done.stdout.splitlines()[-1])
    first = next(iter(results.values()))
    lines = ["| settings | ATen build | train step, ms | generate, ms | weights |", "|---|---|---|---|---|"]
    for name, row in results.items():
        lines.append(f"| {name} | {row['capability']} | {row['train_step_ms']:.0f} "
                     f"({row['train_step_ms'] / first['train_step_ms']:.2f}x) | {row['generate_ms']:.0f} "
                     f"({row['generate_ms'] / first['generate_ms']:.2f}x) | `{row['weights']}` |")
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if args.write:
        from figures import write_blocks, written  # bench/figures.py, beside this file

        block = f"{table}\n{written('bench/cpu_settings.py --write')}; 1 thread, best of 3.\n"
        changed = write_blocks({"cpu-settings": block})
        print("figures:cpu-settings: " + (f"{changed[0].relative_to(ROOT)} written" if changed else "unchanged"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
