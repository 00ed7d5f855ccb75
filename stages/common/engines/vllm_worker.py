"""The vLLM side of `stages/common/engines/vllm_engine.py`: one offline `vllm.LLM`, driven by JSON lines.

Runs in the engine venv (`.venv-vllm`, `make venv-vllm`), which has vLLM and its own transformers but not regraft's
dependencies, so this module imports only the standard library at module level (regraft's venv imports it too,
for the cache key). Requests arrive one JSON object per line on stdin; each answer is one JSON line on the
protocol stream, which is the process's original stdout: fd 1 itself is pointed at stderr (the log) first, so
nothing vLLM or its spawned workers print can corrupt the protocol.

    {"op": "start", "spec": {...}} -> {"ready": true, "startup_seconds": s}   (replaces any running engine)
    {"op": "generate", "prompts": [[ids]], "max_tokens": 64, "temperature": 0, "top_p": 1, "stop_token_ids": [],
     "seed": null | int | [int per prompt]}
      -> {"outputs": [[ids]], "finish_reasons": [...], "seconds": s, "counters": {...}}
    {"op": "hidden_states", "prompts": [[ids]], "out": DIR}
      -> {"paths": [file per prompt], "seconds": s}
    {"op": "exit"}

An engine's settings (`start`): `model`, `dtype`, `max_model_len`, `seed`, `speculative` (vLLM's
`speculative_config` or null), `kv_transfer` (its `kv_transfer_config` or null), plus the CPU settings the parent
picked (`gpu_memory_utilization`, `enforce_eager`, ...). The first line the worker writes, once vLLM is imported,
is `{"imported": s, "versions": {...}}`: this interpreter's versions of the packages that change numbers (vllm,
torch, transformers, ...), which the stage records in its manifest. One worker can start engines one after another
(a probe's speculative and plain ones): with the engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)
the second start takes seconds, not the minute of imports a fresh process pays.
"""
from __future__ import annotations

import json
import os
import sys
import time

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
            "vllm:generation_tokens", "vllm:prompt_tokens")


def protocol_stream():
    """The original stdout for answers; fd 1 from now on writes to stderr (the log)."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def engine(spec: dict):
    import gc

    from vllm import LLM

    gc.collect()  # the engine this one replaces, before a second KV cache is allocated
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])

    kwargs = {key: spec[key] for key in ("model", "tokenizer", "dtype", "max_model_len", "seed", "enforce_eager",
                                         "gpu_memory_utilization", "max_num_seqs", "enable_chunked_prefill",
                                         "enable_prefix_caching", "trust_remote_code", "tensor_parallel_size")
              if spec.get(key) is not None}
    kwargs["disable_log_stats"] = False  # get_metrics() reads the stat loggers' counters
    if spec.get("speculative"):
        kwargs["speculative_config"] = spec["speculative"]
    if spec.get("kv_transfer"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer"])
    if reference_mla_needed(spec.get("dtype"), spec["model"]):
        kwargs["attention_backend"] = "CPU_MLA"
    drafter = (spec.get("speculative") or {}).get("model")
    if drafter and reference_mla_needed(spec.get("dtype"), drafter):  # the drafter's backend is chosen on its own
        kwargs["speculative_config"] = {**spec["speculative"], "attention_backend": "CPU_MLA"}
    return LLM(**kwargs)


def reference_mla_needed(dtype: str | None, model: str) -> bool:
    """A float32 (or float16) MLA model on a CPU: vLLM 0.32's CPU build picks its AMX MLA backend wherever the CPU
    has AMX (platforms/cpu.py get_attn_backend_cls), whatever the dtype, and that backend packs the MLA weights with
    a kernel that takes bfloat16 (float16, int8) only ("expect weight to be bfloat16, float16, int8, ..."), so the
    engine would not start. Such a model asks for the reference CPU_MLA backend, the one CPUs without AMX get."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and dtype not in ("bfloat16", "bf16") and is_mla_model(model)


def is_mla_model(model: str | os.PathLike) -> bool:
    """The model folder's config.json has MLA's kv_lora_rank (at its top or in its text_config)."""
    try:
        with open(os.path.join(model, "config.json")) as config:
            text = json.load(config)
    except (OSError, ValueError):
        return False
    return "kv_lora_rank" in {**text, **text.get("text_config", {})}


def counters(llm) -> dict:
    """vLLM's cumulative counters (per-position acceptance as a list), summed over label sets."""
    values: dict = {}
    for metric in llm.get_metrics():
        if metric.name not in COUNTERS:
            continue
        if hasattr(metric, "values"):  # a Vector: one count per draft position
            previous = values.get(metric.name) or [0] * len(metric.values)
            values[metric.name] = [a + int(b) for a, b in zip(previous, metric.values)]
        else:
            values[metric.name] = values.get(metric.name, 0) + int(metric.value)
    return values


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seeds = request.get("seed")
    seeds = seeds if isinstance(seeds, list) else [seeds] * len(request["prompts"])  # one per prompt, or shared
    params = [SamplingParams(temperature=request.get("temperature", 0.0), top_p=request.get("top_p", 1.0),
                             max_tokens=request["max_tokens"], stop_token_ids=request.get("stop_token_ids") or None,
                             seed=seed, ignore_eos=request.get("ignore_eos", False)) for seed in seeds]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"outputs": [list(result.outputs[0].token_ids) for result in results],
            "finish_reasons": [result.outputs[0].finish_reason for result in results],
            "seconds": seconds, "counters": counters(llm)}


def hidden_states(llm, request: dict) -> dict:
    """One prefill per prompt (max_tokens 1); the connector saves each request's states and names the file."""
    # vLLM loads it by module path; imported here for the cache key
    from stages.common.engines import vllm_hidden_states  # noqa: F401
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    paths = [(result.kv_transfer_params or {}).get("hidden_states_path") for result in results]
    for _ in range(16):  # the connector writes a request's states a step after it finishes: step until it did
        if all(path and os.path.exists(path) for path in paths):
            break
        llm.llm_engine.step()
    return {"paths": paths, "seconds": time.perf_counter() - start}


OPS = {"generate": generate, "hidden_states": hidden_states}


def serve(requests, out) -> None:
    llm = None
    for line in requests:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        try:
            if request["op"] == "start":
                llm = None
                start = time.perf_counter()
                llm = engine(request["spec"])
                answer = {"ready": True, "startup_seconds": time.perf_counter() - start}
            elif llm is None:
                answer = {"error": "no engine: send a start request first"}
            else:
                answer = OPS[request["op"]](llm, request)
        except Exception as exc:  # the parent turns this into one error line naming the log
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")


def main() -> int:
    out = protocol_stream()
    start = time.perf_counter()
    import vllm  # noqa: F401  (the minute of imports, reported apart from the engine's own start)

    from stages.common.contract.artifacts import package_versions  # standard library only at import

    out.write(json.dumps({"imported": time.perf_counter() - start, "versions": package_versions()}) + "\n")
    serve(sys.stdin, out)
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: they re-import this module, which must not start an engine
    sys.exit(main())
