"""Which torch wheel `make venv` installs: the pip arguments for torch==<version>, printed on one line.

    REGRAFT_TORCH=auto   (default) a CUDA build where `nvidia-smi -L` lists a GPU, else the CPU build
    REGRAFT_TORCH=cpu    the CPU build (a laptop, CI, this project's machines)
    REGRAFT_TORCH=cu130  that CUDA build from PyTorch's index: cu128 and up run Blackwell (sm_100, sm_103)

The CPU build is plain `torch==<version>`: where pip is pointed at local wheels (these machines) it takes the CPU
one from there. A CUDA build is pinned by its local label (`torch==2.13.0+cu130`), which only PyTorch's own index
holds, so pip never settles for another build of the same version; that index is an extra one, so the packages
installed beside torch (uv) still come from the usual index. Blackwell needs kernels built for sm_100, which CUDA builds
carry from CUDA 12.8 on: cu126 and older fail at the first kernel on a B200 ("no kernel image is available"), so
they are refused here. Standard library only: it runs before the venv exists.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

CUDA_DEFAULT = "cu130"  # the newest CUDA build PyTorch publishes beside cu128 and cu126 (get-started/previous-versions)
BLACKWELL_FROM = (12, 8)  # the first CUDA release whose builds carry sm_100 kernels
INDEX = "https://download.pytorch.org/whl/{build}"


def sees_a_gpu() -> bool:
    """`nvidia-smi -L` lists at least one GPU (a driver that answers within 10 s)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def cuda_version(build: str) -> tuple[int, int]:
    match = re.fullmatch(r"cu(\d+)(\d)", build)
    if not match:
        raise ValueError(f"REGRAFT_TORCH={build} is not a build: use auto, cpu or a CUDA build such as "
                         f"{CUDA_DEFAULT} (cu128 and up run Blackwell)")
    return int(match[1]), int(match[2])


def choose(version: str, wanted: str, gpu: bool) -> list[str]:
    """The pip arguments that install torch `version` as `wanted` (auto, cpu or cuXYZ) on a machine with or without
    a GPU."""
    build = (CUDA_DEFAULT if gpu else "cpu") if wanted == "auto" else wanted
    if build == "cpu":
        return [f"torch=={version}"]
    if cuda_version(build) < BLACKWELL_FROM:
        raise ValueError(f"REGRAFT_TORCH={build}: CUDA builds before 12.8 carry no Blackwell (sm_100) kernels: use "
                         f"{CUDA_DEFAULT} or cu128")
    return [f"torch=={version}+{build}", "--extra-index-url", INDEX.format(build=build)]


def main(argv: list[str]) -> int:
    version = argv[1] if len(argv) > 1 else "2.13.0"
    wanted = os.environ.get("REGRAFT_TORCH", "auto").strip() or "auto"
    try:
        print(" ".join(choose(version, wanted, sees_a_gpu() if wanted == "auto" else False)))
    except ValueError as error:
        print(f"make venv: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
