"""The `sglang` backend of the probe/evaluate stages: a drafter's accept length measured on a real SGLang server.

In: a target model folder, a drafter folder, conversations (lists of user turns) and a `render` function that turns
chat messages into the target's prompt text (chat template, generation prompt added).
Out: one row per turn (`conversation`, `turn`, `prompt_tokens`, `completion_tokens`, `verify_steps`, `seconds`,
`text`); accept_len is their sum of completion tokens over their sum of verify steps (`accept_length`,
stages/common/drafter/acceptance.py), as SpecForge's benchmarks compute it from SGLang's `meta_info`
(`completion_tokens`, `spec_verify_ct`), greedy, cache flushed first.

The server is started as `python -m sglang.launch_server ... --speculative-algorithm EAGLE3 ...` in its own process
group, its output kept in a log file, and the whole group stopped afterwards; or `server_url` names one already
running. The client uses the standard library only; a server run with `--api-key` gets the key from the variable
`api_key_env` names as a bearer token (stages/common/engines/credentials.py), and a refused key ends the probe at once.

    rows = run_sglang(SglangConfig(), target=..., drafter=..., conversations=[["Hi"]], render=..., ...)
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from stages.common.engines.credentials import DEFAULT_KEY_ENV, UNAUTHORIZED, authorize, refuse_secrets, refused_key
from stages.common.drafter.config import CONVENTIONS, INPUT_OF_LAYER, OUTPUT_OF_LAYER, convert_aux_layer_ids
from stages.common.engines.engine_process import ServerProcess, start_timeout
from stages.common.contract.errors import RegraftError
from stages.common.contract.runtime import free_port

@dataclass
class SglangConfig:
    python: str = "python"  # interpreter that has sglang installed
    launch_module: str = "sglang.launch_server"  # run as `python -m MODULE` (tests: tests.sglang_standin)
    server_url: str | None = None  # use this running server (http://host:port); nothing is started or stopped
    api_key_env: str = DEFAULT_KEY_ENV  # the environment variable holding server_url's --api-key (if it has one)
    api_key: str | None = None  # never set: refused (a setting is written to .hydra/, manifests, MLflow)
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    tp: int = 1  # tensor-parallel size (--tp-size)
    mem_fraction_static: float | None = None  # None = SGLang's own choice
    extra_args: list[str] = field(default_factory=list)  # appended verbatim, e.g. ["--trust-remote-code"]
    # None: scaled with the checkpoints (engine_process.start_timeout: 900 s, and their weights at an assumed 0.5 GB/s)
    startup_timeout_s: float | None = None
    request_timeout_s: float = 600.0  # one /generate call
    stop_grace_s: float = 30.0  # SIGTERM to the process group, then SIGKILL after this


def launch_command(cfg: SglangConfig, target: str, port: int, speculative: list[str] = ()) -> list[str]:
    """`python -m sglang.launch_server` on the target (with `speculative`'s flags); flag names as in SGLang's
    `ServerArgs` (`tp_size` is `--tp-size`)."""
    command = [cfg.python, "-m", cfg.launch_module, "--model-path", target, *speculative,
               "--tp-size", str(cfg.tp), "--host", cfg.host, "--port", str(port)]
    if cfg.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    return command + list(cfg.extra_args)


def server_command(cfg: SglangConfig, target: str, drafter: str, num_steps: int, topk: int,
                   num_draft_tokens: int, port: int) -> list[str]:
    """The launch command of a target speculating with an EAGLE-3 drafter."""
    return launch_command(cfg, target, port, [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter,
        "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(topk),
        "--speculative-num-draft-tokens", str(num_draft_tokens)])


MODEL_FLAGS = ("--model-path", "--speculative-draft-model-path")  # the checkpoints a server loads as it starts


def _flag(command: list[str], name: str) -> str:
    """The value of a flag in a launch command; the last occurrence wins, as in argparse."""
    positions = [i for i, arg in enumerate(command[:-1]) if arg == name]
    if not positions:
        raise RegraftError(None, f"the launch command has no {name}: {' '.join(command)}",
                           "build it with server_command")
    return command[positions[-1] + 1]


def client_url(host: str, port: str) -> str:
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


class SglangServer(ServerProcess):
    """Context manager: start `command` (its own process group, output to `log_path`), wait for `GET /health`
    to answer 200, yield; on exit stop the whole group, also after an exception. With `cfg.server_url` set it
    only checks that server's health: nothing is started, nothing stopped (`ServerProcess`)."""

    def __init__(self, cfg: SglangConfig, command: list[str] | None, log_path: Path):
        if cfg.server_url:
            url, command = cfg.server_url, None
        elif command:
            url = client_url(_flag(command, "--host"), _flag(command, "--port"))
        else:
            raise RegraftError(None, "no SGLang server to use", "set sglang.server_url or give a launch command")
        models = [_flag(command, name) for name in MODEL_FLAGS if command and name in command]
        super().__init__("SGLang server", command, url, log_path, settings="sglang",
                         startup_timeout_s=start_timeout(cfg.startup_timeout_s, *models),
                         request_timeout_s=cfg.request_timeout_s, stop_grace_s=cfg.stop_grace_s)
        self.cfg = cfg


def _post(url: str, payload: dict | None, timeout: float, key_env: str = DEFAULT_KEY_ENV) -> bytes:
    data = b"" if payload is None else json.dumps(payload).encode()
    request = authorize(urllib.request.Request(url, data=data, method="POST",
                                               headers={"Content-Type": "application/json"}), key_env)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.read()
    except urllib.error.HTTPError as exc:
        body = " ".join(exc.read().decode(errors="replace").split())[:300]
        if exc.code in UNAUTHORIZED:
            raise refused_key(key_env, url, exc.code, body) from None
        raise RegraftError(url, f"HTTP {exc.code}: {body}", "read the server log") from exc
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RegraftError(url, f"request failed ({reason})",
                           "check that the server runs; raise sglang.request_timeout_s if it timed out") from exc


def generate(url: str, text: str, max_new_tokens: int, timeout: float,
             key_env: str = DEFAULT_KEY_ENV) -> dict[str, Any]:
    """POST /generate greedily; returns `text`, `completion_tokens`, `spec_verify_ct` (and `prompt_tokens`)."""
    where = f"{url}/generate"
    raw = _post(where, {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}},
                timeout, key_env)
    try:
        answer = json.loads(raw)
        meta = answer["meta_info"]
        out = {"text": answer["text"], "completion_tokens": int(meta["completion_tokens"])}
    except (ValueError, KeyError, TypeError) as exc:
        raise RegraftError(where, f"not an SGLang /generate answer: {raw[:200]!r}",
                           "point sglang.server_url at an SGLang server") from exc
    if "spec_verify_ct" not in meta:
        raise RegraftError(where, "meta_info has no spec_verify_ct: the server runs without speculative decoding",
                           "start it with --speculative-algorithm EAGLE3 and --speculative-draft-model-path")
    out["spec_verify_ct"] = int(meta["spec_verify_ct"])
    if "prompt_tokens" in meta:
        out["prompt_tokens"] = int(meta["prompt_tokens"])
    return out


def flush_cache(url: str, timeout: float = 60.0, key_env: str = DEFAULT_KEY_ENV) -> None:
    """POST /flush_cache; SGLang refuses (400) while requests run."""
    _post(f"{url}/flush_cache", None, timeout, key_env)


def run_sglang(cfg: SglangConfig, *, target: str, drafter: str, conversations: list[list[str]],
               render: Callable[[list[dict]], str], max_new_tokens: int, num_steps: int, topk: int,
               num_draft_tokens: int, log_path: Path) -> list[dict]:
    """Every turn of every conversation through one server (started here unless `cfg.server_url`); one row each."""
    refuse_secrets(cfg, "sglang")
    command = None
    if not cfg.server_url:
        port = cfg.port or free_port(cfg.host)
        command = server_command(cfg, target, drafter, num_steps, topk, num_draft_tokens, port)
    with SglangServer(cfg, command, log_path) as server:
        try:
            flush_cache(server.url, cfg.request_timeout_s, cfg.api_key_env)
            return [row for index, turns in enumerate(conversations) for row in
                    _conversation(server.url, index, turns, render, max_new_tokens, cfg.request_timeout_s,
                                  cfg.api_key_env)]
        except RegraftError:
            # a crash explains the failed request better; its socket closes a moment before it can be reaped
            server.raise_if_exited("during the probe", wait_s=1.0)
            raise


def _conversation(url: str, index: int, turns: list[str], render: Callable[[list[dict]], str],
                  max_new_tokens: int, timeout: float, key_env: str) -> Iterator[dict]:
    """Each turn sees the earlier turns with the answers generated for them, as SGLang's MT-Bench benchmark does."""
    messages: list[dict] = []
    for turn, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        text = render([dict(m) for m in messages])
        start = time.perf_counter()
        out = generate(url, text, max_new_tokens, timeout, key_env)
        seconds = time.perf_counter() - start
        messages.append({"role": "assistant", "content": out["text"]})
        yield {"conversation": index, "turn": turn, "prompt_tokens": out.get("prompt_tokens", -1),
               "completion_tokens": out["completion_tokens"], "verify_steps": out["spec_verify_ct"],
               "seconds": seconds, "text": out["text"]}


# --- aux hidden-state layer convention --------------------------------------------------------------------------

ENGINES = ("sglang", "vllm")


def engine_reading(ids: list[int], engine: str) -> str:
    """How an engine reads explicit aux ids. SGLang (since sgl-project/sglang PR #25454) adds one to a list whose
    first id is 1 (reads it as output of layer) and passes any other list through (input of layer); vLLM always
    passes ids through (input of layer)."""
    if engine == "sglang":
        return OUTPUT_OF_LAYER if ids[0] == 1 else INPUT_OF_LAYER
    return INPUT_OF_LAYER


def drafter_convention(config: dict) -> tuple[list[int] | None, str, str]:
    """(aux ids, convention, "recorded"/"inferred") of a drafter's config.json, inferred as
    stages.common.drafter.checkpoint does: first id 1 -> output_of_layer, 2 -> input_of_layer, else the layout's default
    (sglang: output_of_layer, speculators: input_of_layer)."""
    eagle = config.get("eagle_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    recorded = (config.get("regraft") or {}).get("aux_convention")
    if recorded in CONVENTIONS:
        return ids, recorded, "recorded"
    if ids and ids[0] in (1, 2):
        return ids, OUTPUT_OF_LAYER if ids[0] == 1 else INPUT_OF_LAYER, "inferred"
    speculators = "speculators_model_type" in config
    return ids, INPUT_OF_LAYER if speculators else OUTPUT_OF_LAYER, "inferred"


def aux_convention_warning(drafter_config: dict, engine: str = "sglang") -> str | None:
    """One line when `engine` would feed the drafter hidden states one layer off from those it was trained on.

    Rule: the drafter's ids and convention come from `drafter_convention` (recorded in `regraft.aux_convention`,
    else inferred); the engine's reading from `engine_reading`. They differ, for SGLang, when an input_of_layer
    list starts at 1 (SGLang adds one: one layer too deep) or an output_of_layer list does not start at 1 (SGLang
    passes it through: one layer too shallow); for vLLM, whenever the list is output_of_layer. No ids: the
    engine uses its own defaults ([2, L//2, L-3] as input of layer, the field's standard), so no warning.
    SGLang before PR #25454 added one to every explicit list; with such a version input_of_layer drafters are
    off by one too, which this function cannot see.
    """
    if engine not in ENGINES:
        raise RegraftError(None, f"unknown engine {engine!r}", f"use one of {', '.join(ENGINES)}")
    ids, convention, source = drafter_convention(drafter_config)
    if not ids:
        return None
    reading = engine_reading(ids, engine)
    if reading == convention:
        return None
    depth = "deeper" if reading == OUTPUT_OF_LAYER else "shallower"
    converted = convert_aux_layer_ids(ids, convention, reading)
    if engine_reading(converted, engine) == reading:
        layout = "sglang" if engine == "sglang" else "speculators"
        fix = (f"convert it: python -m stages.common.drafter.checkpoint DRAFTER OUT --layout {layout} "
               f"--aux-convention {reading}")
    else:
        fix = (f"no id list names these layers for {engine}: converted to {reading} ({converted}) they would be "
               f"read as {engine_reading(converted, engine)}")
    return (f"{engine} reads aux ids {list(ids)} as {reading} but the drafter's are {convention} ({source}): "
            f"it would get hidden states one layer {depth} than it was trained on; {fix}")
