"""Process-level helpers every stage shares: the environment every regraft process starts with, a free local port,
torch's intra-op threads for a while, and the settings that make torch's CPU float results the same on every x86
machine."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator

# unless the user set them: MLflow sends no telemetry (nothing here reaches the internet), and tokenizers keeps no
# thread pool that a forked job would inherit
PROCESS_DEFAULTS = {"MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false"}


def set_process_defaults() -> None:
    """PROCESS_DEFAULTS into os.environ, under what is already set: the command, every job, the tests, benchmarks."""
    for key, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(key, value)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (a rendezvous, a server); the OS picks it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """`count` intra-op threads inside the block (None or 0: torch's setting), restored afterwards."""
    import torch  # here, so that free_port stays importable without torch (the SGLang client)

    before = torch.get_num_threads()
    if count and count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


# ---------------------------------------------------------------- the same numbers on every x86 CPU
#
# torch on CPU picks its code by the CPU it finds, in two places, and each choice changes float results in the
# last bits (which training and sampling then amplify into another world):
# - MKL (torch's BLAS: every linear layer) picks a GEMM kernel per CPU (AUTO: AVX-512 on one Intel part, AVX2 on
#   another, its own path on AMD). MKL_CBWR=COMPATIBLE is MKL's conditional numerical reproducibility: one code
#   path on every Intel and compatible x86 CPU (for one MKL version and a fixed thread count). On AMD it is the
#   only branch MKL accepts besides AUTO.
# - ATen's own kernels (softmax, norms, reductions, the normal sampler, the optimizers' element-wise math) are
#   compiled three times and dispatched by CPU: DEFAULT, AVX2, AVX512. ATEN_CPU_CAPABILITY=avx2 takes the AVX2
#   build (its math from the SLEEF compiled into torch) on every CPU that has AVX2 (Intel since 2013, AMD since
#   2015); `default` would cover older CPUs too, but its math comes from the system's libm (which differs between
#   glibc versions and dispatches on FMA itself) and costs a quarter more.
# Both are read when first used (MKL's first call, ATen's first dispatch), not at import: set in os.environ before
# a process computes anything, they take effect. oneDNN is not on the fp32 path these stages take; a fixed thread
# count is the stage's own setting (the world's `threads`, the launcher's OMP_NUM_THREADS).
# Measured: docs/world.md (bench/cpu_settings.py); tests/test_determinism.py.
SAME_ON_EVERY_CPU = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}
# mkl_cbwr.h: mkl_cbwr_get(MKL_CBWR_BRANCH) answers the branch in use: MKL_CBWR_BRANCH_OFF (1, none asked for),
# MKL_CBWR_AUTO (2) or MKL_CBWR_COMPATIBLE (3)
_MKL_CBWR_BRANCH, _MKL_CBWR_AUTO, _MKL_CBWR_COMPATIBLE = 1, 2, 3


def _mkl_cbwr(set_compatible: bool) -> int | None:
    """MKL's current branch (_MKL_CBWR_COMPATIBLE: 3), after asking for COMPATIBLE if `set_compatible`; None: no
    MKL."""
    import ctypes

    import torch

    if not torch.backends.mkl.is_available():
        return None
    try:  # torch links MKL statically into libtorch_cpu and exports its service calls
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get, put = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_set
    except (OSError, AttributeError):
        return None
    if set_compatible:
        put(_MKL_CBWR_COMPATIBLE)  # refused (MKL_CBWR_ERR_MODE_CHANGE_FAILURE) once MKL ran in another mode
    return get(_MKL_CBWR_BRANCH)


def compute_as_every_cpu() -> None:
    """SAME_ON_EVERY_CPU into os.environ, without importing torch: every process started from here (and this one,
    if it computes later) takes it at its first torch op. What the orchestrator does; a stage checks it with
    `same_on_every_cpu`."""
    os.environ.update(SAME_ON_EVERY_CPU)


def same_on_every_cpu() -> dict[str, object]:
    """Make this process (and the processes it starts) compute as every x86 CPU does: SAME_ON_EVERY_CPU into
    os.environ, then each setting checked. Too late for a setting once this process has used it (a torch op ran
    before with other settings): `in_effect` is then False and the caller decides (the world stage builds in a
    fresh interpreter). Returns what is in effect, for a manifest."""
    compute_as_every_cpu()
    import torch

    capability = torch._C._get_cpu_capability()  # computed from the environment at the first call, then fixed
    branch = _mkl_cbwr(set_compatible=True)
    wanted = SAME_ON_EVERY_CPU["ATEN_CPU_CAPABILITY"].upper()
    in_effect = capability == wanted and branch in (None, _MKL_CBWR_COMPATIBLE)
    names = {None: "no MKL", 1: "OFF", _MKL_CBWR_AUTO: "AUTO", _MKL_CBWR_COMPATIBLE: "COMPATIBLE"}
    return {"in_effect": in_effect, "cpu_capability": capability, "mkl_cbwr": names.get(branch, f"branch {branch}"),
            "torch": torch.__version__, "threads": torch.get_num_threads()}
