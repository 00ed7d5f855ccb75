"""Benchmark for a GPU: one TTT training step at the Kimi-K2.5 drafter's shape, for each drafter family, beside
NeMo Automodel 0.7.0's trainer doing the same step on the same GPU; the fine-tune stage's own loop on one rank
(DeepSpeed, AdamW, bf16, the target head on the GPU) with its peak memory beside the estimate the plan uses; and
vLLM's hidden-state extraction rate.

The shape is the seeds' Kimi-K2.5 drafter (SpecForge PR #108, ../shared/field-notes.md): hidden 7168, 64 heads of
128, intermediate 18432, draft vocab 32,000 of a 163,840-id target, MLA drafters with kv_lora_rank 512, rope 64,
q_lora_rank 1536; one sequence of 2,048 tokens, 7 TTT steps, bf16, random weights and states. Per family: tokens
per second of forward + backward (median of --steps after one warm-up) and the peak GPU memory
(torch.cuda.max_memory_allocated). NeMo's step runs in the reference venv (`make venv-ref`), whose torch must see
the GPU; vLLM's rate needs a GPU build of vLLM at --vllm-python and a target folder at --vllm-target. What cannot
run says why in the table instead of a figure.

    .venv/bin/python bench/gpu.py                       # on a machine with a GPU (~5 min on one H200)
    .venv/bin/python bench/gpu.py --device cpu --scale 16 --seq 128 --steps 1   # the same code, small, on CPU
    .venv/bin/python bench/gpu.py --write               # the figure block in docs/results.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = ("eagle3", "eagle3.1", "mla", "mla3.1")
KIMI = {"hidden": 7168, "heads": 64, "head_dim": 128, "intermediate": 18432, "draft_vocab": 32000,
        "target_vocab": 163840, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
REFERENCE_PYTHON = ROOT / ".venv-ref" / "bin" / "python"


def shape(scale: int) -> dict:
    """The Kimi-K2.5 drafter's sizes, each width divided by `scale` (head width and MLA's latent and rope widths
    kept). Its attention is wider than its hidden state (64 heads x 128 = 8192 against 7168), as the drafter's is."""
    sizes = dict(KIMI)
    for key in ("hidden", "heads", "intermediate", "draft_vocab", "target_vocab", "q_lora_rank"):
        sizes[key] = max(1, sizes[key] // scale)
    return sizes


def layer_fields(family: str, sizes: dict) -> dict:
    layer = {"model_type": "llama", "hidden_size": sizes["hidden"], "num_attention_heads": sizes["heads"],
             "num_key_value_heads": sizes["heads"], "head_dim": sizes["head_dim"],
             "intermediate_size": sizes["intermediate"], "vocab_size": sizes["target_vocab"], "num_hidden_layers": 1,
             "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 8192}
    if family.startswith("mla"):
        layer.update(model_type="deepseek_v2", q_lora_rank=sizes["q_lora_rank"], kv_lora_rank=sizes["kv_lora_rank"],
                     qk_rope_head_dim=sizes["qk_rope_head_dim"], qk_nope_head_dim=sizes["head_dim"],
                     v_head_dim=sizes["head_dim"])
    return layer


def random_inputs(sizes: dict, seq: int, device, dtype, selected):
    import torch

    generator = torch.Generator(device="cpu").manual_seed(1)
    logits = torch.randn(1, seq, sizes["target_vocab"], generator=generator).to(device, dtype)
    logits[..., selected.to(device)] += 2.0  # most target argmaxes inside the draft vocab
    return {"input_ids": torch.randint(0, sizes["target_vocab"], (1, seq), generator=generator).to(device),
            "loss_mask": torch.ones(1, seq, dtype=torch.long, device=device),
            "aux": torch.randn(1, seq, 3 * sizes["hidden"], generator=generator).to(device, dtype), "logits": logits}


def regraft_step(family: str, sizes: dict, seq: int, ttt_steps: int, steps: int, device: str) -> dict:
    """regraft's TTT step (stages/common/drafter/ttt.py), forward + backward."""
    import torch

    from stages.common.drafter.config import DrafterConfig, FAMILY_FLAGS
    from stages.common.drafter.eagle3 import Eagle3Drafter
    from stages.common.drafter.target import TargetSignals
    from stages.common.drafter.ttt import draft_vocab_ids, ttt_forward
    from stages.common.drafter.vocab import VocabMap

    torch.manual_seed(0)
    dtype = torch.bfloat16
    config = DrafterConfig(layer=layer_fields(family, sizes), draft_vocab_size=sizes["draft_vocab"],
                           **FAMILY_FLAGS[family])
    ids = torch.randperm(sizes["target_vocab"])[: sizes["draft_vocab"]].sort().values
    drafter = Eagle3Drafter.initialised(config, VocabMap.from_target_ids(ids, sizes["target_vocab"]))
    drafter = drafter.to(device, dtype)
    embedding = torch.nn.Embedding(sizes["target_vocab"], sizes["hidden"]).to(device, dtype).requires_grad_(False)
    batch = random_inputs(sizes, seq, device, dtype, ids)
    signals = TargetSignals.from_logits(batch["logits"], draft_vocab_ids(drafter))

    def step() -> None:
        stats = ttt_forward(drafter, embedding, batch["input_ids"], batch["loss_mask"], batch["aux"], signals,
                            ttt_steps)
        stats.loss.backward()
        drafter.zero_grad(set_to_none=True)

    return timed(step, steps, seq, device) | {"params": sum(p.numel() for p in drafter.parameters())}


def finetune_path(family: str, sizes: dict, seq: int, ttt_steps: int, steps: int, device: str) -> dict:
    """The fine-tune stage's own loop (`stages.finetune.loop.train`) on one rank for `steps` optimizer steps:
    DeepSpeed (ZeRO-0; bf16 on a GPU), AdamW, the target's head on the rank's device, and batches of cached states
    from host memory, moved as the stage moves them (pinned, read ahead); beside it, the fake-tensor estimate of
    the same rank's peak (`stages.common.drafter.memory`). Its tokens/s is the loop's own (metrics.jsonl), the step after
    one warm-up."""
    import torch

    from stages.common.contract.stage import compose_stage
    from stages.common.data.feature_shards import TensorRows
    from stages.common.drafter.config import DrafterConfig, FAMILY_FLAGS
    from stages.common.drafter.eagle3 import Eagle3Drafter
    from stages.common.drafter.target import TargetHead
    from stages.common.drafter.vocab import VocabMap
    from stages.finetune import init_distributed
    from stages.finetune.loop import MetricsLog, Progress, train
    from stages.common.drafter.memory import fine_tune_memory

    rank_device = init_distributed(False, 0, "cpu" if device == "cpu" else "auto")
    dtype = torch.bfloat16 if rank_device.type == "cuda" else torch.float32
    config = DrafterConfig(layer=layer_fields(family, sizes), draft_vocab_size=sizes["draft_vocab"],
                           **FAMILY_FLAGS[family])
    ids = torch.randperm(sizes["target_vocab"], generator=torch.Generator().manual_seed(0))[: sizes["draft_vocab"]]
    drafter = Eagle3Drafter.initialised(config, VocabMap.from_target_ids(ids.sort().values, sizes["target_vocab"]))
    drafter.to(rank_device)
    generator = torch.Generator().manual_seed(1)
    head = TargetHead.of(torch.randn(sizes["target_vocab"], sizes["hidden"], generator=generator),
                         torch.randn(sizes["target_vocab"], sizes["hidden"], generator=generator) / 64)
    head = TargetHead.of(head.embedding.weight.to(rank_device, dtype), head.lm_head.to(rank_device, dtype))
    rows = 1 + steps
    data = TensorRows({"input_ids": torch.randint(0, sizes["target_vocab"], (rows, seq), generator=generator),
                       "attention_mask": torch.ones(rows, seq, dtype=torch.long),
                       "loss_mask": torch.ones(rows, seq, dtype=torch.long),
                       "aux_hidden": torch.randn(rows, seq, 3 * sizes["hidden"], generator=generator).to(dtype),
                       "last_hidden": torch.randn(rows, seq, sizes["hidden"], generator=generator).to(dtype)})
    with tempfile.TemporaryDirectory() as work:
        cfg = compose_stage("finetune", ["target=unused", "vocab_map=unused", f"out={work}/out", "init=scratch",
                                         f"ttt_steps={ttt_steps}", "micro_batch_size=1", f"max_length={seq}",
                                         f"max_steps={rows}", "val_fraction=0", "log_every=1",
                                         "checkpoint_every=1000000", "deepspeed.zero_stage=0"])
        if rank_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        log = MetricsLog(Path(work) / "metrics.jsonl", resume_step=0, enabled=True)
        train(cfg, drafter, head, data, TensorRows({key: value[:0] for key, value in data.data.items()}),
              Path(work), log, Progress())
        lines = [json.loads(line) for line in (Path(work) / "metrics.jsonl").read_text().splitlines()]
    estimate = fine_tune_memory(config, micro_batch=1, seq=seq, ttt_steps=ttt_steps, zero_stage=0, gpus_per_node=1,
                                dtype=dtype)
    peak = torch.cuda.max_memory_allocated() / 2**30 if rank_device.type == "cuda" else None
    return {"tokens_s": lines[-1]["tokens_per_s"], "peak_gib": peak, "estimate_gib": estimate.total / 2**30,
            "loss": lines[-1]["loss"], "device": str(rank_device), "dtype": str(dtype).removeprefix("torch.")}


def timed(step, steps: int, seq: int, device: str) -> dict:
    import torch

    cuda = device.startswith("cuda")
    step()  # warm-up: kernels chosen, memory pooled
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"seconds": seconds, "tokens_s": seq / seconds, "peak_gib": peak}


def nemo_step(family: str, sizes: dict, seq: int, ttt_steps: int, steps: int, device: str) -> dict | str:
    """NeMo Automodel's Eagle3TrainerModule on the same shape, in the reference venv; or why it cannot run."""
    if not REFERENCE_PYTHON.exists():
        return "no reference venv (make venv-ref)"
    if family == "eagle3.1":
        return "NeMo has no norm_before_fc (regraft's eagle3.1 build)"
    case = {"family": family, "layer": layer_fields(family, sizes), "sizes": sizes, "seq": seq,
            "ttt_steps": ttt_steps, "steps": steps, "device": device}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "case.json").write_text(json.dumps(case))
        done = subprocess.run([str(REFERENCE_PYTHON), str(ROOT / "bench" / "gpu_nemo.py"), f"{folder}/case.json"],
                              capture_output=True, text=True, cwd=folder)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return f"failed: {last[:120]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def vllm_rate(python: str, target: str | None, data: str | None) -> dict | str:
    """vLLM's hidden-state extraction on a target folder: tokens per second of the features stage's vLLM backend
    (its start-up included)."""
    if not target or not data:
        return "not run: give --vllm-target (a model folder on this machine) and --vllm-data (chat JSONL)"
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                           text=True)
    if probe.stdout.strip() != "True":
        return f"{python}: its torch sees no GPU (a vLLM GPU build is needed)"
    with tempfile.TemporaryDirectory() as outputs:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "stages.features", f"target={target}",
                               f"data={data}", f"out={outputs}/features",
                               "backend=vllm", "vllm_connector=stock", f"vllm.python={python}", "dtype=bfloat16"],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return (done.stdout + done.stderr).strip().splitlines()[-1]
        manifest = json.loads((Path(outputs) / "features" / "manifest.json").read_text())
    return {"tokens": manifest["metrics"]["tokens"], "tokens_s": manifest["metrics"]["tokens"] /
            (time.perf_counter() - started)}


def table(rows: list[dict], sizes: dict, seq: int, ttt_steps: int, device: str, vllm: dict | str) -> str:
    lines = ["| family | params | regraft tok/s | regraft peak GiB | NeMo tok/s | NeMo peak GiB | regraft / NeMo |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, theirs = row["regraft"], row["nemo"]
        gib = (lambda value: f"{value:.1f}" if value is not None else "-")  # noqa: E731
        if isinstance(theirs, dict):
            speedup = ours["tokens_s"] / theirs["tokens_s"]
            nemo = f"{theirs['tokens_s']:,.0f} | {gib(theirs['peak_gib'])} | {speedup:.2f}x"
        else:
            nemo = f"{theirs} | - | -"
        lines.append(f"| {row['family']} | {ours['params'] / 1e9:.2f} B | {ours['tokens_s']:,.0f} | "
                     f"{gib(ours['peak_gib'])} | {nemo} |")
    rate = f"{vllm['tokens_s']:,.0f} tokens/s over {vllm['tokens']:,} tokens" if isinstance(vllm, dict) else vllm
    lines += ["", f"Shape: hidden {sizes['hidden']}, {sizes['heads']} heads, draft vocab {sizes['draft_vocab']:,} of "
              f"{sizes['target_vocab']:,}, one sequence of {seq:,} tokens, {ttt_steps} TTT steps, bf16, on {device}. "
              f"vLLM hidden-state extraction: {rate}."]
    return "\n".join(lines)


def loop_table(rows: list[dict]) -> str:
    """The fine-tune stage's own loop on one rank, its measured peak beside the fake-tensor estimate."""
    lines = ["| family | the stage's loop tok/s | peak GiB | estimated GiB | on | loss |", "|---|---|---|---|---|---|"]
    for row in rows:
        loop = row["loop"]
        peak = f"{loop['peak_gib']:.1f}" if loop["peak_gib"] is not None else "-"
        lines.append(f"| {row['family']} | {loop['tokens_s']:,.0f} | {peak} | {loop['estimate_gib']:.1f} | "
                     f"{loop['device']} {loop['dtype']} | {loop['loss']:.3f} |")
    return "\n".join(lines + ["", "The stage's loop: stages.finetune.loop.train on one rank (DeepSpeed ZeRO-0, AdamW, "
                               "the target head on the device), tokens/s its own; estimated: stages.common.drafter.memory."])


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=int, default=1, help="divide the widths by this (a small run on CPU)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--vllm-target", default=None)
    parser.add_argument("--vllm-data", default=None)
    parser.add_argument("--write", action="store_true", help="write the block gpu-step in docs/results.md")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/gpu.py: no GPU here (torch.cuda.is_available() is False); it has not run. On CPU, small: "
              "--device cpu --scale 16 --seq 128 --steps 1")
        return 1
    sizes = shape(args.scale)
    rows = []
    for family in args.families.split(","):
        ours = regraft_step(family, sizes, args.seq, args.ttt_steps, args.steps, args.device)
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
        rows.append({"family": family, "regraft": ours,
                     "nemo": nemo_step(family, sizes, args.seq, args.ttt_steps, args.steps, args.device),
                     "loop": finetune_path(family, sizes, args.seq, args.ttt_steps, args.steps, args.device)})
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    report = table(rows, sizes, args.seq, args.ttt_steps, device_name(args.device),
                   vllm_rate(args.vllm_python, args.vllm_target, args.vllm_data)) + "\n\n" + loop_table(rows)
    print(report)
    if args.write:
        from figures import write_blocks, written  # bench/figures.py, beside this file

        write_blocks({"gpu-step": report + "\n\n" + written(" ".join(["bench/gpu.py", *sys.argv[1:]])) + "\n"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
