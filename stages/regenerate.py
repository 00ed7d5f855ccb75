"""regenerate stage: the new target answers the training prompts itself, as EAGLE-3 data is prepared, so the drafter
learns the distribution it will draft for.

In: `data` (chat JSONL, `{"messages": [...]}` per line, as stages/common/data/chat.py reads it, an optional `id`) and an
engine. Each user turn is asked in order, on the history of the target's own earlier answers; system messages stay
where they are, the data's assistant messages are dropped. Roles other than system/user/assistant, or no user turn,
reject the sample unasked.
- `engine=vllm`: vLLM's offline engine in the engine venv (`make venv-vllm`) on `target`. Prompts are rendered
  here with the target's chat template (stages/common/data/chat_prompts.py) and asked turn depth by turn depth: each
  depth one batched generate over the samples of a chunk (`batch_size`) that have that many turns.
- `engine=openai`: any OpenAI-compatible server (SGLang's, vLLM's) at `server_url`, `POST /v1/chat/completions`
  with `concurrency` requests in flight, each sample turn by turn; `extra_body` is merged into every request
  (`chat_template_kwargs`, `top_k`, ...; on the command line `+extra_body.top_k=20`). A server run with
  `--api-key` gets the key from the environment variable `api_key_env` names (REGRAFT_API_KEY) as a bearer token;
  the key is never a setting (`api_key=` is refused), and a refused key ends the stage at once, naming the variable.
Sampling: `temperature`, `top_p`, `max_tokens`. The openai engine sends each turn a seed drawn from `seed`, the
sample's id and the turn; the offline engine gets one seed per turn depth (its worker takes one per call), which
vLLM applies per request, so an answer does not depend on its batch either way; temperature 0 is greedy.
Out: `regenerated.jsonl` (the input lines in input order, `id` added, each assistant message the target's answer,
`reasoning_content` kept when a server's reasoning parser split it off), `rejects.jsonl` (`{"id", "reason"}`: an
empty answer, a request the server refused, a prompt past the context length), `engine.log` (vllm) and
`manifest.json` (samples, answered, rejected, turns, tokens; seconds of this run, and `resumed`: the samples an
earlier run had finished).

Ids: a line's `id` (a string or an integer) if it has one, else the first 16 hex digits of the sha256 of the line's
JSON (keys sorted), with `-2`, `-3`, ... for the later copies of an identical line; so ids never depend on line
numbers, and every input line gives one sample.

Resumable by id: each finished sample (answered or rejected) is appended to `<out>.work/samples.jsonl`, flushed and
fsync'd, as it finishes (vllm: as its chunk finishes). A rerun with the same settings skips the ids found there; a
torn last line (kill -9 mid-write) is cut off and that sample asked again. The output is written from that file in
input order, so every sample appears exactly once (in one of the two files); the work folder is removed once the
output is complete. A rejected sample is finished too: delete the work folder to ask it again.

    python -m stages.regenerate data=chats.jsonl out=DIR target=MODEL_DIR [engine=vllm] [temperature=0.7]
    REGRAFT_API_KEY=... python -m stages.regenerate data=chats.jsonl out=DIR engine=openai \
        server_url=http://host:30000 concurrency=128
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

from omegaconf import DictConfig
from tqdm import tqdm

from stages.common.contract.artifacts import engine_fields, plain_config, staged_output
from stages.common.data.chat import batched, load_tokenizer, read_chat_records
from stages.common.data.chat_prompts import context_length, prompt_ids, stop_ids
from stages.common.data.parts import part_manifests, part_slice
from stages.common.contract.errors import RegraftError
from stages.common.engines.openai_client import Refused, chat_completion, served_models
from stages.common.contract.stage import StageResult, stage_main
from stages.common.contract.runtime import free_port
from stages.common.engines.engine_process import HOST, ServerProcess, start_timeout
from stages.common.engines.sglang_backend import client_url, launch_command
from stages.common.engines.vllm_engine import VllmEngine, server_command, server_env
from stages.schemas.regenerate import Engine, Serve, check_regenerate, check_vllm_targets, started_here

WORK_FILE, SETTINGS_FILE = "samples.jsonl", "settings.json"
ID_DIGITS = 16


# --- samples ----------------------------------------------------------------------------------------------------

@dataclass
class Sample:
    id: str
    record: dict  # the input line, its messages included
    turns: list[list[dict]] = field(default_factory=list)  # the messages before each answer, each ending with a user's
    tail: list[dict] = field(default_factory=list)  # messages after the last user turn
    problem: Optional[str] = None  # why it cannot be asked; rejected unasked


def plan_turns(sample: Sample) -> Sample:
    """Split the messages at each user message; assistant messages are dropped, their answers regenerated."""
    pending: list[dict] = []
    for message in sample.record["messages"]:
        if message["role"] == "assistant":
            continue
        if message["role"] not in ("system", "user"):
            sample.problem = f"role {message['role']!r} cannot be regenerated (system, user and assistant only)"
            return sample
        pending.append(message)
        if message["role"] == "user":
            sample.turns.append(pending)
            pending = []
    sample.tail = pending
    if not sample.turns:
        sample.problem = "no user turn to answer"
    return sample


def content_id(record: dict) -> str:
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:ID_DIGITS]


def sample_id(record: dict, where: str, copies: Counter) -> str:
    given = record.get("id")
    if given is None:
        digest = content_id(record)
        copies[digest] += 1
        return digest if copies[digest] == 1 else f"{digest}-{copies[digest]}"
    if isinstance(given, bool) or not isinstance(given, (str, int)):
        raise RegraftError(where, f"id {given!r} is not a string or an integer",
                           "give each line a string id, or none (regraft then hashes the line)")
    return str(given)


def read_samples(path: Path, limit: int | None) -> list[Sample]:
    """The samples of a chat JSONL file in file order, each with its id and turns; ids must be unique."""
    samples, lines, copies = [], {}, Counter()
    for where, record in read_chat_records(path):
        key = sample_id(record, where, copies)
        if key in lines:
            raise RegraftError(where, f"id {key!r} is already the id of line {lines[key]}",
                               "give every line its own id, or none (regraft then hashes the line)")
        lines[key] = where.rsplit(":", 1)[1]
        samples.append(plan_turns(Sample(key, record)))
        if limit is not None and len(samples) == limit:
            break
    if not samples:
        raise RegraftError(path, "holds no conversations", 'give data= a JSONL file of {"messages": [...]} lines')
    return samples


def answered(sample: Sample, answers: list[dict], tokens: int) -> dict:
    messages = [m for turn, answer in zip(sample.turns, answers) for m in (*turn, answer)] + sample.tail
    return {"id": sample.id, "messages": messages, "tokens": tokens}


def rejected(sample: Sample, reason: str) -> dict:
    return {"id": sample.id, "reason": reason}


def sample_seed(seed: int, key: str, turn: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{key}/{turn}".encode()).digest()[:4], "big") >> 1


def empty_answer(turn: int, finish_reason: str | None) -> str:
    return f"turn {turn + 1}: empty answer (finish_reason {finish_reason})"


# --- the work file: finished samples, kept across kills ------------------------------------------------------------

class WorkLog:
    """`samples.jsonl` in the work folder: one finished sample per line, appended, flushed and fsync'd, so a kill
    loses only what had not finished; `settings.json` beside it says what asked them."""

    def __init__(self, folder: Path, settings: dict):
        self.folder, self.path = folder, folder / WORK_FILE
        folder.mkdir(parents=True, exist_ok=True)
        written = folder / SETTINGS_FILE
        if written.exists() and json.loads(written.read_text()) != settings:
            raise RegraftError(folder, f"holds samples asked with other settings ({written.read_text().strip()})",
                               "rerun with those settings, or delete the folder to start over")
        written.write_text(json.dumps(settings, sort_keys=True))
        self.records = self.load()
        self.handle = self.path.open("ab")

    def load(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        raw = self.path.read_bytes()
        whole = raw[: raw.rfind(b"\n") + 1]  # a last line without its newline was cut by a kill: ask it again
        if len(whole) != len(raw):
            with self.path.open("r+b") as handle:
                handle.truncate(len(whole))
        records = {}
        for number, line in enumerate(whole.decode().splitlines(), start=1):
            try:
                record = json.loads(line)
                records[record["id"]] = record
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise RegraftError(f"{self.path}:{number}", f"not a finished sample ({exc})",
                                   "delete the work folder to start over") from None
        return records

    def append(self, records: Iterable[dict]) -> None:
        records = list(records)
        self.handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.records.update((r["id"], r) for r in records)

    def close(self) -> None:
        self.handle.close()


# --- engine=openai --------------------------------------------------------------------------------------------------

def server_model(cfg: DictConfig, url: str) -> str:
    models = served_models(url, cfg.request_timeout_s, cfg.retries, cfg.api_key_env)
    if cfg.model:
        if cfg.model not in models:
            raise RegraftError(f"model={cfg.model}", f"is not served at {url} (it serves {', '.join(models)})",
                               "set model= to one of those, or leave it unset")
        return cfg.model
    if len(models) != 1:
        raise RegraftError(f"{url}/v1/models", f"lists {len(models)} models ({', '.join(models)})",
                           "set model= to the one that answers")
    return models[0]


@dataclass(frozen=True)
class Asking:
    """What every request of a run shares, as plain values for the worker threads."""

    url: str
    body: dict  # model, sampling settings and extra_body
    seed: int
    timeout: float
    retries: int
    key_env: str  # the variable holding the server's key (read by each request, never kept here)


def converse(asking: Asking, sample: Sample) -> dict:
    """One sample, turn by turn, each turn on the server's own earlier answers (their reasoning left out, as
    chat templates leave it out of earlier turns)."""
    history: list[dict] = []
    answers, tokens = [], 0
    for turn, messages in enumerate(sample.turns):
        history = [*history, *messages]
        payload = {**asking.body, "messages": history, "seed": sample_seed(asking.seed, sample.id, turn)}
        try:
            answer = chat_completion(asking.url, payload, asking.timeout, asking.retries, asking.key_env)
        except Refused as refusal:
            return rejected(sample, f"turn {turn + 1}: the server refused it: {refusal}")
        if not answer.text.strip():
            return rejected(sample, empty_answer(turn, answer.finish_reason))
        history = [*history, {"role": "assistant", "content": answer.text}]
        answers.append({**history[-1], "reasoning_content": answer.reasoning} if answer.reasoning else history[-1])
        tokens += answer.completion_tokens
    return answered(sample, answers, tokens)


def ask_openai(cfg: DictConfig, url: str, samples: list[Sample], model: str, log: WorkLog, progress: tqdm) -> None:
    """`concurrency` samples in flight (twice that queued); each finished one goes to the work log at once."""
    body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p,
            **plain_config(cfg.extra_body)}
    asking = Asking(url, body, cfg.seed, cfg.request_timeout_s, cfg.retries, cfg.api_key_env)
    queue = iter(samples)
    with ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
        running: set = set()
        try:
            while True:
                while len(running) < 2 * cfg.concurrency and (sample := next(queue, None)) is not None:
                    running.add(pool.submit(converse, asking, sample))
                if not running:
                    return
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                log.append(future.result() for future in finished)
                progress.update(len(finished))
        except BaseException:
            for future in running:
                future.cancel()
            raise


@contextlib.contextmanager
def openai_server(cfg: DictConfig, folder: Path) -> Iterator[str]:
    """The URL to ask: `server_url` (a server on another node), or the server `serve` names, started here on the
    target (its log `server.log` in `folder`) and stopped when the block ends, so it holds the node's GPUs only while
    the stage runs."""
    if cfg.server_url:
        yield cfg.server_url.rstrip("/")
        return
    with started_server(cfg, folder / "server.log") as server:
        yield server.url


def started_server(cfg: DictConfig, log_path: Path) -> ServerProcess:
    """`serve`'s server on the target, with its engine's settings and the stage's trust_remote_code; its start
    timeout scaled with the checkpoint unless set."""
    target = str(Path(cfg.target).absolute())
    if Serve(cfg.serve) is Serve.sglang:
        port = cfg.sglang.port or free_port(cfg.sglang.host)
        command = launch_command(cfg.sglang, target, port) + (["--trust-remote-code"] if cfg.trust_remote_code else [])
        return ServerProcess("SGLang server", command, client_url(cfg.sglang.host, port), log_path,
                             settings="regenerate.sglang",
                             startup_timeout_s=start_timeout(cfg.sglang.startup_timeout_s, target),
                             request_timeout_s=cfg.request_timeout_s, stop_grace_s=cfg.sglang.stop_grace_s)
    port = free_port(HOST)
    command = server_command(cfg.vllm, target, dtype=cfg.dtype, host=HOST, port=port,
                             max_model_len=cfg.vllm.max_model_len, trust_remote_code=cfg.trust_remote_code)
    return ServerProcess("vLLM server", command, f"http://{HOST}:{port}", log_path, settings="regenerate.vllm",
                         startup_timeout_s=start_timeout(cfg.vllm.startup_timeout_s, target),
                         request_timeout_s=cfg.request_timeout_s, stop_grace_s=cfg.vllm.stop_grace_s,
                         env=server_env(cfg.vllm))


# --- engine=vllm ----------------------------------------------------------------------------------------------------

@dataclass
class Asked:
    """One sample while its chunk is asked depth by depth."""

    sample: Sample
    history: list[dict] = field(default_factory=list)
    answers: list[dict] = field(default_factory=list)
    tokens: int = 0
    reason: Optional[str] = None


def ask_chunk(cfg: DictConfig, engine: VllmEngine, tokenizer, chunk: list[Sample], stops: list[int],
              limit: int | None) -> list[dict]:
    """Every turn of a chunk's samples: one generate per turn depth over the samples that reach it."""
    states = [Asked(sample) for sample in chunk]
    for depth in range(max(len(sample.turns) for sample in chunk)):
        asking, prompts = [], []
        for state in states:
            if state.reason is None and depth < len(state.sample.turns):
                state.history += state.sample.turns[depth]
                ids = prompt_ids(tokenizer, state.history)
                if limit is not None and len(ids) >= limit:
                    state.reason = f"turn {depth + 1}: prompt of {len(ids)} tokens leaves no room under the " \
                                   f"engine's max_model_len {limit}"
                    continue
                asking.append(state)
                prompts.append(ids)
        if not prompts:
            continue
        out = engine.generate(prompts, cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              stop_token_ids=stops,
                              seed=[sample_seed(cfg.seed, state.sample.id, depth) for state in asking])
        for state, ids, finish in zip(asking, out["outputs"], out["finish_reasons"]):
            # a cut-off multi-byte character decodes to U+FFFD; servers' detokenizers hold it back, and so does this
            text = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
            if not text.strip():
                state.reason = empty_answer(depth, finish)
                continue
            reply = {"role": "assistant", "content": text}
            state.history.append(reply)
            state.answers.append(reply)
            state.tokens += len(ids)
    return [rejected(s.sample, s.reason) if s.reason else answered(s.sample, s.answers, s.tokens) for s in states]


def ask_vllm(cfg: DictConfig, samples: list[Sample], log: WorkLog, progress: tqdm) -> dict:
    """Every sample through the engine, chunk by chunk into the log; returns what ran it (for the manifest)."""
    target = Path(cfg.target)
    tokenizer = load_tokenizer(target, cfg.trust_remote_code)
    stops, limit = sorted(stop_ids(tokenizer, target)), cfg.vllm.max_model_len or context_length(target)
    with VllmEngine(cfg.vllm, log.folder / "engine.log") as engine:
        engine.start(target, dtype=cfg.dtype, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
        for chunk in batched(iter(samples), cfg.batch_size):
            log.append(ask_chunk(cfg, engine, tokenizer, chunk, stops, limit))
            progress.update(len(chunk))
    return engine.provenance()


# --- the stage ------------------------------------------------------------------------------------------------------

def settings(cfg: DictConfig, model: str) -> dict:
    """What decides the answers: a work folder made under other settings is not resumed."""
    return {"data": str(Path(cfg.data).absolute()), "engine": Engine(cfg.engine).value, "model": model,
            "temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens, "seed": cfg.seed,
            "extra_body": plain_config(cfg.extra_body)}


def write_outputs(samples: list[Sample], records: dict[str, dict], out: Path) -> dict[str, float]:
    """regenerated.jsonl and rejects.jsonl in input order, one line per sample; their counts."""
    counts = Counter()
    with (out / "regenerated.jsonl").open("w") as good, (out / "rejects.jsonl").open("w") as bad:
        for sample in samples:
            record = records[sample.id]
            if "reason" in record:
                bad.write(json.dumps({"id": sample.id, "reason": record["reason"]}, ensure_ascii=False) + "\n")
                counts["rejected"] += 1
                continue
            others = {key: value for key, value in sample.record.items() if key not in ("id", "messages")}
            line = {"id": sample.id, **others, "messages": record["messages"]}
            good.write(json.dumps(line, ensure_ascii=False) + "\n")
            counts["answered"] += 1
            counts["turns"] += len(sample.turns)
            counts["tokens"] += record["tokens"]
    return {"samples": len(samples), "answered": counts["answered"], "rejected": counts["rejected"],
            "turns": counts["turns"], "tokens": counts["tokens"]}


def join_parts(cfg: DictConfig) -> StageResult:
    """The parts' lines in order, their counts summed: what one job asking every sample writes."""
    manifests = part_manifests(list(cfg.part_outputs), "regenerate")
    for part, manifest in zip(cfg.part_outputs[1:], manifests[1:]):
        if manifest["model"] != manifests[0]["model"]:
            raise RegraftError(part, f"was answered by {manifest['model']}, {cfg.part_outputs[0]} by "
                               f"{manifests[0]['model']}", "join the parts of one regenerate run")
    with staged_output(cfg.out, "regenerate", cfg) as staged:
        for name in ("regenerated.jsonl", "rejects.jsonl"):
            with (staged.path / name).open("wb") as joined:
                for part in cfg.part_outputs:
                    with (Path(part) / name).open("rb") as lines:
                        shutil.copyfileobj(lines, joined)
        counted = ("samples", "answered", "rejected", "turns", "tokens", "seconds", "resumed")
        metrics = {key: sum(manifest["metrics"][key] for manifest in manifests) for key in counted}
        model = manifests[0]["model"]
        headline = (f"{metrics['answered']} of {metrics['samples']} samples answered by {model} "
                    f"({metrics['rejected']} rejected) in {len(cfg.part_outputs)} parts, {metrics['tokens']} tokens")
        staged.update(metrics=metrics, headline=headline, model=model,
                      part_outputs=[str(Path(part).absolute()) for part in cfg.part_outputs],
                      **engine_fields(manifests[0]),
                      inputs={"data": str(Path(cfg.data).absolute()), "engine": Engine(cfg.engine).value})
    return StageResult(Path(cfg.out), metrics, headline)


def run(cfg: DictConfig) -> StageResult:
    check_regenerate(cfg, "")
    if cfg.part_outputs:
        return join_parts(cfg)
    engine = Engine(cfg.engine)
    serve = started_here(cfg)
    if (engine is Engine.vllm or serve) and not cfg.target:
        what = f"serve={serve.value}" if serve else "engine=vllm"
        raise RegraftError("target", f"{what} needs the target model", "set target= to the model folder")
    check_vllm_targets(cfg, "")  # no MLA target on vLLM's CPU build
    # ids are taken over the whole file first, so a sample keeps its id (and its seed) whichever part asks it
    samples = read_samples(Path(cfg.data), cfg.num_samples)
    samples = samples[part_slice(len(samples), cfg.part, cfg.parts, "regenerate", "samples")]
    work_dir = f"{cfg.work_dir}.part{cfg.part}" if cfg.work_dir and cfg.part is not None else cfg.work_dir
    folder = Path(work_dir or f"{cfg.out}.work")
    folder.mkdir(parents=True, exist_ok=True)
    start, engine_run = time.perf_counter(), {}  # the engine's interpreter and versions, when one ran
    with openai_server(cfg, folder) if engine is Engine.openai else contextlib.nullcontext() as url:
        model = server_model(cfg, url) if url else str(Path(cfg.target).absolute())
        log = WorkLog(folder, settings(cfg, model))
        resumed = sum(sample.id in log.records for sample in samples)
        try:
            pending = [sample for sample in samples if sample.id not in log.records]
            log.append(rejected(sample, sample.problem) for sample in pending if sample.problem)
            pending = [sample for sample in pending if not sample.problem]
            with tqdm(total=len(samples), initial=len(samples) - len(pending), desc="regenerate", unit="sample",
                      mininterval=1.0) as progress:
                if url:
                    ask_openai(cfg, url, pending, model, log, progress)
                elif pending:
                    engine_run = ask_vllm(cfg, pending, log, progress)
        finally:
            log.close()
    seconds = time.perf_counter() - start
    with staged_output(cfg.out, "regenerate", cfg) as staged:
        metrics = {**write_outputs(samples, log.records, staged.path), "seconds": seconds, "resumed": resumed}
        for name in ("engine.log", "server.log"):  # vllm's engine, or the server serve started
            if (log.folder / name).exists():
                shutil.copy(log.folder / name, staged.path / name)
        headline = (f"{metrics['answered']} of {metrics['samples']} samples answered by {model} "
                    f"({metrics['rejected']} rejected), {metrics['tokens']} tokens")
        staged.update(metrics=metrics, headline=headline, model=model, part=cfg.part, **engine_run,
                      inputs={"data": str(Path(cfg.data).absolute()), "engine": engine.value})
    shutil.rmtree(log.folder, ignore_errors=True)
    return StageResult(Path(cfg.out), metrics, headline)


if __name__ == "__main__":
    raise SystemExit(stage_main("regenerate", run))
