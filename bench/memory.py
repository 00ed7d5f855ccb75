"""A fine-tune's peak GPU memory per rank, as the plan estimates it (stages/common/drafter/memory.py), for the Kimi-K2.5
drafter at `experiment=kimi_k25`'s settings and around them: each drafter family, sequence length and ZeRO stage,
beside a B200's memory. Seconds on any machine (no GPU: the step runs on the meta device).

    .venv/bin/python bench/memory.py            # the table
    .venv/bin/python bench/memory.py --write    # the block gpu-memory in docs/gpu.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

B200_GB = 180  # HGX B200: 1,440 GB of HBM3e over 8 GPUs (NVIDIA's datasheet)
CASES = [  # (family, tokens, TTT steps, ZeRO stage): the experiment's own first
    ("eagle3", 2048, 5, 2), ("mla", 2048, 5, 2), ("eagle3", 2048, 7, 2), ("eagle3", 8192, 5, 2),
    ("eagle3", 2048, 5, 0), ("eagle3", 2048, 5, 3), ("eagle3", 32768, 5, 2)]


def kimi_drafter(family: str):
    """The seeds' Kimi-K2.5 drafter (SpecForge PR #108): hidden 7168, 64 heads of 128, intermediate 18432, draft
    vocab 32,000 of 163,840; the MLA family with the Kimi line's latent ranks."""
    from stages.common.drafter.config import FAMILY_FLAGS, DrafterConfig

    layer = {"model_type": "llama", "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
             "head_dim": 128, "intermediate_size": 18432, "vocab_size": 163840, "num_hidden_layers": 1,
             "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 8192}
    if family.startswith("mla"):
        layer.update(model_type="deepseek_v2", q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                     qk_nope_head_dim=128, v_head_dim=128)
    return DrafterConfig(layer=layer, draft_vocab_size=32000, **FAMILY_FLAGS[family])


def table() -> str:
    from stages.common.drafter.memory import HEADROOM, fine_tune_memory

    gib = 2 ** 30
    lines = ["| family | tokens | TTT steps | ZeRO | model states GiB | step GiB | target head GiB | total GiB | "
             f"fits a B200 ({B200_GB} GB, {HEADROOM:.0%} kept free) |", "|---|---|---|---|---|---|---|---|---|"]
    for family, tokens, steps, zero in CASES:
        estimate = fine_tune_memory(kimi_drafter(family), micro_batch=1, seq=tokens, ttt_steps=steps,
                                    zero_stage=zero, gpus_per_node=8)
        lines.append(f"| {family} | {tokens:,} | {steps} | {zero} | {estimate.model_states / gib:.1f} | "
                     f"{estimate.step / gib:.1f} | {estimate.target_side / gib:.1f} | {estimate.total / gib:.1f} | "
                     f"{'yes' if estimate.fits(B200_GB * 1e9) else 'no'} |")
    return "\n".join(lines + ["", "One rank of 8 on one node, micro-batch 1, bf16; the first row is "
                              "`experiment=kimi_k25`'s fine-tune."])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the block gpu-memory in docs/gpu.md")
    args = parser.parse_args()
    report = table()
    print(report)
    if args.write:
        from figures import write_blocks, written  # bench/figures.py, beside this file

        write_blocks({"gpu-memory": report + "\n\n" + written(" ".join(["bench/memory.py", *sys.argv[1:]])) + "\n"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
