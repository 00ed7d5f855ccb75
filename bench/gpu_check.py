"""The first thing to run on a machine with a GPU: does regraft's GPU path work here, end to end? (`make gpu-check`)

It runs, each under a time limit, and prints one table of what passed:
1. torch: a CUDA build that sees the GPU, was built for its architecture (Blackwell is sm_100 / sm_103, which
   needs a CUDA 12.8+ build), and has bf16 and NCCL;
2. `regraft debug=tiny` on the GPU: the whole pipeline small, its fine-tunes on DeepSpeed with NCCL and bf16 on the
   GPU (`finetune.device=cuda`), every fine-tune's manifest saying so;
3. the same with the probe on vLLM's engine on the GPU, where a vLLM GPU build is installed (`--vllm-python`; its
   world wide enough for vLLM's attention kernels), else said to be skipped;
4. `bench/gpu.py`: one TTT step at the Kimi-K2.5 drafter's shape per family beside NeMo Automodel's, and the
   fine-tune stage's own loop on one rank with its peak memory beside the plan's estimate.
Exit 0 when every check that ran passed. Its outputs go to a fresh folder (`--outputs`, default a temp folder) and
each check's log beside them.

    make gpu-check                                   # = .venv/bin/python bench/gpu_check.py
    .venv/bin/python bench/gpu_check.py --vllm-python /opt/vllm/bin/python --families eagle3
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGRAFT = [str(Path(sys.executable).parent / "regraft")]  # the venv's command, as `make run` calls it
CUDA_TORCH = ("install torch's CUDA build in .venv: .venv/bin/pip install torch==2.13.0 --index-url "
              "https://download.pytorch.org/whl/cu128 (CUDA 12.8+ for Blackwell)")


@dataclass
class Check:
    name: str
    passed: bool | None  # None: skipped
    detail: str
    seconds: float = 0.0


def torch_check() -> Check:
    """A CUDA torch that sees a GPU and was built for it, with bf16 and NCCL."""
    import torch

    if not torch.cuda.is_available():
        return Check("torch sees a GPU", False, f"torch {torch.__version__} sees none; {CUDA_TORCH}")
    major, minor = torch.cuda.get_device_capability(0)
    arch, built = f"sm_{major}{minor}", torch.cuda.get_arch_list()
    name = torch.cuda.get_device_name(0)
    problems = [f"this torch was not built for {arch} (it has {', '.join(built)}); {CUDA_TORCH}"] \
        if arch not in built and f"compute_{major}{minor}" not in built else []
    if not torch.cuda.is_bf16_supported():
        problems.append("no bf16 on this GPU")
    if not torch.distributed.is_nccl_available():
        problems.append("this torch has no NCCL")
    detail = f"{torch.cuda.device_count()} x {name} ({arch}), torch {torch.__version__}, CUDA {torch.version.cuda}"
    return Check("torch sees a GPU", not problems, "; ".join([detail, *problems]))


def run_logged(command: list[str], log: Path, timeout_s: float) -> tuple[int, str]:
    """Exit code and last line of a command, its whole output in `log`; a command past its time is stopped."""
    with log.open("w") as out:
        try:
            code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return 124, f"stopped after {timeout_s:.0f} s"
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return code, lines[-1].strip() if lines else ""


def finetunes_on_gpu(outputs: Path) -> list[str]:
    """Problems with the fine-tunes of a run: each manifest must say it trained on a GPU in bf16."""
    manifests = sorted((outputs / "cache" / "finetune").glob("*/manifest.json"))
    if not manifests:
        return ["no fine-tune output"]
    problems = []
    for path in manifests:
        manifest = json.loads(path.read_text())
        if not str(manifest.get("device", "")).startswith("cuda") or manifest.get("precision") != "bf16":
            problems.append(f"{path.parent.name}: trained on {manifest.get('device')} in {manifest.get('precision')}")
    return problems


def pipeline_check(name: str, overrides: list[str], outputs: Path, timeout_s: float) -> Check:
    """`regraft debug=tiny` with `overrides`, on the GPU: it ends well and every fine-tune trained on the GPU."""
    started = time.perf_counter()
    command = [*REGRAFT, "debug=tiny", "finetune.device=cuda", f"paths.outputs={outputs}", *overrides]
    code, last = run_logged(command, outputs.with_suffix(".log"), timeout_s)
    seconds = time.perf_counter() - started
    if code != 0:
        return Check(name, False, f"exit {code}: {last} (log: {outputs.with_suffix('.log')})", seconds)
    problems = finetunes_on_gpu(outputs)
    manifests = len(list((outputs / "cache" / "finetune").glob("*/manifest.json")))
    return Check(name, not problems, "; ".join(problems) or f"{manifests} fine-tunes on the GPU in bf16", seconds)


def vllm_overrides(python: str) -> list[str]:
    """The probe on vLLM's GPU engine; the world 128 wide with 2 heads, as vLLM's attention kernels want heads of
    64 (the tiny world's are 16)."""
    engine = [f"probe.vllm.python={python}", "probe.vllm.kvcache_space_gib=null", "probe.vllm.threads=null",
              "probe.vllm.gpu_memory_utilization=0.3", "probe.vllm.in_process=false"]
    return ["probe.backend=vllm", *engine, "world.hidden_size=128", "world.num_heads=2"]


def vllm_sees_gpu(python: str) -> bool:
    try:
        probe = subprocess.run([python, "-c", "import torch, vllm; print(torch.cuda.is_available())"],
                               capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.stdout.strip().endswith("True")


def bench_check(families: str, outputs: Path, timeout_s: float) -> Check:
    started = time.perf_counter()
    log = outputs / "bench-gpu.log"
    code, last = run_logged([sys.executable, str(ROOT / "bench" / "gpu.py"), "--families", families], log, timeout_s)
    detail = f"table in {log}" if code == 0 else f"exit {code}: {last} (log: {log})"
    return Check("bench/gpu.py (Kimi-shape TTT step, the stage's loop)", code == 0, detail,
                 time.perf_counter() - started)


def report(checks: list[Check]) -> str:
    marks = {True: "passed", False: "FAILED", None: "skipped"}
    lines = ["| check | result | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {check.name} | {marks[check.passed]} | {check.seconds:.0f} | {check.detail} |" for check in checks]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=Path, default=None, help="a fresh folder for the runs (default: a temp one)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--families", default="eagle3,eagle3.1,mla,mla3.1", help="bench/gpu.py's families")
    parser.add_argument("--timeout-s", type=float, default=1800, help="each check's time limit")
    args = parser.parse_args()
    outputs = args.outputs or Path(tempfile.mkdtemp(prefix="regraft-gpu-check-"))
    outputs.mkdir(parents=True, exist_ok=True)
    checks = [torch_check()]
    if checks[0].passed:
        checks.append(pipeline_check("regraft debug=tiny on the GPU (DeepSpeed, NCCL, bf16)", [], outputs / "tiny",
                                     args.timeout_s))
        if Path(args.vllm_python).exists() and vllm_sees_gpu(args.vllm_python):
            checks.append(pipeline_check("the same, the probe on vLLM's GPU engine", vllm_overrides(args.vllm_python),
                                         outputs / "tiny-vllm", args.timeout_s))
        else:
            checks.append(Check("the same, the probe on vLLM's GPU engine", None,
                                f"no vLLM GPU build at {args.vllm_python} (--vllm-python)"))
        checks.append(bench_check(args.families, outputs, args.timeout_s))
    print(report(checks))
    print(f"outputs and logs: {outputs}")
    return 0 if all(check.passed is not False for check in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
