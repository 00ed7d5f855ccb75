"""regenerate against real engines: a `vllm.entrypoints.openai.api_server` from the engine venv (started once for the
module) and vLLM's offline engine, on conftest's `engine_target` (trained, so its answers are words; heads of 32
dims, the least vLLM's CPU attention takes). The samples' ids and turns, the work file and the config rules are
checked without an engine."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from stages import regenerate
from stages.common.contract.errors import RegraftError
from stages.common.contract.stage import compose_stage
from stages.schemas.regenerate import holds
from tests.servers import HOST, MAX_MODEL_LEN, REPO, needs_engine, reply, vllm_server

MAX_TOKENS = 24

USERS = "alpha bravo charlie kilo lima mike".split()


def chat_lines() -> list[dict]:
    """24 chats: one and two turns, a system message, explicit ids on some, one exact copy of another line."""
    lines = []
    for i in range(24):
        messages = [{"role": "system", "content": "answer briefly"}] if i % 6 == 0 else []
        for turn in range(1 + (i % 4 == 1)):
            messages += [{"role": "user", "content": USERS[(i + 2 * turn) % 6]},
                         {"role": "assistant", "content": "the old answer"}]
        lines.append({"id": f"chat-{i}", "messages": messages} if i % 5 == 0 else {"messages": messages})
    return lines + [dict(lines[3])]


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def stage_cfg(data: Path, out: Path, *extra: str):
    return compose_stage("regenerate", [f"data={data}", f"out={out}", f"max_tokens={MAX_TOKENS}", *extra])


def answers(out: Path) -> dict[str, list[dict]]:
    return {line["id"]: line["messages"] for line in map(json.loads, (out / "regenerated.jsonl").open())}


def ids_in(out: Path, name: str) -> list[str]:
    return [json.loads(line)["id"] for line in (out / name).open()]


# --- engines, once per module -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server_url(engine_target, tmp_path_factory):
    with vllm_server(engine_target, tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_lines(tmp_path_factory.mktemp("data") / "chats.jsonl", chat_lines())


@pytest.fixture(scope="module")
def uninterrupted(server_url, data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    regenerate.run(stage_cfg(data, out, "engine=openai", f"server_url={server_url}", "concurrency=4"))
    return out


class Recorder(BaseHTTPRequestHandler):
    """A pass-through in front of the real server that keeps every chat request's body."""

    upstream, bodies = "", []

    def do_GET(self) -> None:
        self.relay(None)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(body))
        self.relay(body)

    def relay(self, body: bytes | None) -> None:
        request = urllib.request.Request(self.upstream + self.path, data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            payload, status = answer.read(), answer.status
        reply(self, status, payload)

    def log_message(self, *args) -> None:
        pass


# --- the openai engine against a real vLLM server -------------------------------------------------------------------


@needs_engine
def test_every_line_is_one_sample_in_input_order_with_the_targets_answers(uninterrupted, data):
    lines = [json.loads(line) for line in data.open()]
    ids = ids_in(uninterrupted, "regenerated.jsonl")
    assert len(ids) == len(set(ids)) == len(lines) and ids[0] == "chat-0" and ids[5] == "chat-5"
    assert ids[-1] == f"{ids[3]}-2"  # the exact copy of line 4: the same hash, its second occurrence
    assert ids[3] == regenerate.content_id(lines[3])
    regenerated = answers(uninterrupted)
    for key, line in zip(ids, lines):
        roles = [m["role"] for m in line["messages"]]
        assert [m["role"] for m in regenerated[key]] == roles
        assert [m for m in regenerated[key] if m["role"] != "assistant"] == \
            [m for m in line["messages"] if m["role"] != "assistant"]  # system and user messages kept
        assert all(m["content"].strip() and m["content"] != "the old answer"
                   for m in regenerated[key] if m["role"] == "assistant")
    metrics = json.loads((uninterrupted / "manifest.json").read_text())["metrics"]
    assert (metrics["samples"], metrics["answered"], metrics["rejected"], metrics["turns"]) == (25, 25, 0, 31)
    assert metrics["tokens"] > 25 and metrics["resumed"] == 0
    assert not Path(f"{uninterrupted}.work").exists()


@needs_engine
def test_parts_asked_by_their_own_jobs_join_into_what_one_job_writes(server_url, data, uninterrupted, tmp_path):
    serving = ("engine=openai", f"server_url={server_url}", "concurrency=4", "parts=3")
    parts = [tmp_path / f"part{index}" for index in range(3)]
    for index, part in enumerate(parts):
        regenerate.run(stage_cfg(data, part, *serving, f"part={index}"))
    joined = regenerate.run(stage_cfg(data, tmp_path / "joined", *serving,
                                      f"part_outputs=[{','.join(map(str, parts))}]"))
    for name in ("regenerated.jsonl", "rejects.jsonl"):
        assert (joined.out / name).read_bytes() == (uninterrupted / name).read_bytes()
    whole = json.loads((uninterrupted / "manifest.json").read_text())["metrics"]
    assert {key: joined.metrics[key] for key in ("samples", "answered", "rejected", "turns", "tokens")} == \
        {key: whole[key] for key in ("samples", "answered", "rejected", "turns", "tokens")}
    assert [len(ids_in(part, "regenerated.jsonl")) + len(ids_in(part, "rejects.jsonl")) for part in parts] == [8, 8, 9]


@needs_engine
def test_kill_9_mid_run_then_rerun_gives_every_sample_once_and_the_same_answers(server_url, data,
                                                                                uninterrupted, tmp_path):
    out, work = tmp_path / "out", tmp_path / "out.work" / regenerate.WORK_FILE
    command = [sys.executable, "-m", "stages.regenerate", f"data={data}", f"out={out}", "engine=openai",
               f"server_url={server_url}", "concurrency=1", f"max_tokens={MAX_TOKENS}"]
    with (tmp_path / "killed.log").open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (work.exists() and work.read_bytes().count(b"\n") >= 4) and time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "killed.log").read_text()
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    done = work.read_bytes().count(b"\n")
    assert 4 <= done < 25 and not out.exists()
    with work.open("ab") as torn:  # what a kill in the middle of a write leaves: half a line, no newline
        torn.write(b'{"id": "chat-20", "messages": [{"role": "us')
    result = regenerate.run(stage_cfg(data, out, "engine=openai", f"server_url={server_url}", "concurrency=2"))
    assert result.metrics["resumed"] == done and result.metrics["samples"] == 25
    assert ids_in(out, "regenerated.jsonl") == ids_in(uninterrupted, "regenerated.jsonl")
    assert answers(out) == answers(uninterrupted)  # temperature 0: the resumed run asks what the first asked
    assert not (tmp_path / "out.work").exists()


@needs_engine
def test_turn_two_is_asked_on_the_engines_own_turn_one_answer(server_url, data, tmp_path):
    Recorder.upstream, Recorder.bodies = server_url, []
    proxy = ThreadingHTTPServer((HOST, 0), Recorder)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "out"
        regenerate.run(stage_cfg(data, out, "engine=openai", f"server_url=http://{HOST}:{proxy.server_port}",
                                 "num_samples=2", "concurrency=1"))
    finally:
        proxy.shutdown()
    two_turns = answers(out)[ids_in(out, "regenerated.jsonl")[1]]  # line 2 has two turns
    first, second = [b for b in Recorder.bodies if b["messages"][0] == two_turns[0]]
    assert first["messages"] == two_turns[:1]
    assert second["messages"] == two_turns[:3] and second["messages"][1]["content"] != "the old answer"
    assert first["seed"] != second["seed"] and first["temperature"] == 0


@needs_engine
def test_refused_and_empty_answers_are_rejected_with_their_reason(server_url, tmp_path):
    long = " ".join(["alpha"] * 400)  # past the server's max_model_len
    data = write_lines(tmp_path / "chats.jsonl", [
        {"id": "fine", "messages": [{"role": "user", "content": "alpha"}]},
        {"id": "long", "messages": [{"role": "user", "content": long}]},
        {"id": "tool", "messages": [{"role": "user", "content": "alpha"}, {"role": "tool", "content": "{}"}]},
        {"id": "silent", "messages": [{"role": "assistant", "content": "hello"}]}])
    out = tmp_path / "out"
    result = regenerate.run(stage_cfg(data, out, "engine=openai", f"server_url={server_url}"))
    reasons = {r["id"]: r["reason"] for r in map(json.loads, (out / "rejects.jsonl").open())}
    assert list(reasons) == ["long", "tool", "silent"] and ids_in(out, "regenerated.jsonl") == ["fine"]
    assert reasons["long"].startswith("turn 1: the server refused it: HTTP 400: ")
    assert "maximum context length is 256" in reasons["long"]
    assert reasons["tool"] == "role 'tool' cannot be regenerated (system, user and assistant only)"
    assert reasons["silent"] == "no user turn to answer"
    assert (result.metrics["answered"], result.metrics["rejected"]) == (1, 3)
    eos = json.loads((Path(result.out) / "manifest.json").read_text())  # the same run's record
    assert eos["complete"] and "rejects.jsonl" in eos["files"]
    # the end of turn as the first token: the server answers, with nothing in it
    empty = regenerate.run(stage_cfg(data, tmp_path / "empty", "engine=openai", f"server_url={server_url}",
                                     "num_samples=1", "+extra_body.logit_bias={1: 100}"))
    assert empty.metrics["rejected"] == 1
    assert json.loads((tmp_path / "empty" / "rejects.jsonl").read_text()) == {
        "id": "fine", "reason": "turn 1: empty answer (finish_reason stop)"}


@needs_engine
def test_vllm_offline_answers_equal_the_servers_at_temperature_0(engine_target, data, uninterrupted, tmp_path):
    lines = [json.loads(line) for line in data.open()][:6] + [
        {"id": "long", "messages": [{"role": "user", "content": " ".join(["alpha"] * 400)}]}]
    out = tmp_path / "out"
    result = regenerate.run(stage_cfg(write_lines(tmp_path / "chats.jsonl", lines), out, f"target={engine_target}",
                                      "dtype=float32", f"vllm.max_model_len={MAX_MODEL_LEN}", "batch_size=4"))
    offline, served = answers(out), answers(uninterrupted)
    assert list(offline) == ids_in(uninterrupted, "regenerated.jsonl")[:6]
    assert offline == {key: served[key] for key in offline}  # two-turn samples included: line 2 and line 6
    assert json.loads((out / "rejects.jsonl").read_text())["reason"].startswith(
        "turn 1: prompt of ") and f"max_model_len {MAX_MODEL_LEN}" in (out / "rejects.jsonl").read_text()
    assert (out / "engine.log").exists() and result.metrics["tokens"] > 0


# --- without an engine: ids, turns, the work file, the config rules -------------------------------------------------

def test_ids_come_from_the_line_or_its_content_and_never_repeat(tmp_path):
    lines = [{"messages": [{"role": "user", "content": "a"}]}, {"id": 7, "messages": [{"role": "user", "content": "b"}]}]
    samples = regenerate.read_samples(write_lines(tmp_path / "a.jsonl", lines + [lines[0]]), None)
    assert [s.id for s in samples] == [regenerate.content_id(lines[0]), "7", regenerate.content_id(lines[0]) + "-2"]
    moved = regenerate.read_samples(write_lines(tmp_path / "b.jsonl", [lines[1], lines[0]]), None)
    assert [s.id for s in moved] == ["7", samples[0].id]  # a line's id does not depend on where it is
    with pytest.raises(RegraftError, match=r"b\.jsonl:2: id '7' is already the id of line 1"):
        regenerate.read_samples(write_lines(tmp_path / "b.jsonl", [lines[1], lines[1]]), None)
    with pytest.raises(RegraftError, match=r"c\.jsonl:1: id \[1\] is not a string or an integer"):
        regenerate.read_samples(write_lines(tmp_path / "c.jsonl", [{"id": [1], **lines[0]}]), None)


def test_turns_split_at_each_user_message_and_keep_system_messages_in_place():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "system", "content": "s2"},
                {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    sample = regenerate.plan_turns(regenerate.Sample("x", {"messages": messages}))
    assert sample.turns == [messages[:2], messages[3:5]] and sample.tail == [] and sample.problem is None
    record = regenerate.answered(sample, [{"role": "assistant", "content": "n1"},
                                          {"role": "assistant", "content": "n2"}], 5)
    assert [m["content"] for m in record["messages"]] == ["s", "u1", "n1", "s2", "u2", "n2"]


@needs_engine
def test_a_server_the_stage_starts_answers_as_one_at_a_url_and_is_stopped_after(engine_target, data, uninterrupted,
                                                                               tmp_path, monkeypatch):
    """serve=vllm: the stage starts vLLM's OpenAI server on the target (as the module's server runs it: float32,
    its model length, torch's own threads), asks it, keeps its log and stops its process group."""
    started = []

    def recorded(cfg, log_path):
        started.append(server := real(cfg, log_path))
        return server

    real = regenerate.started_server
    monkeypatch.setattr(regenerate, "started_server", recorded)
    out = tmp_path / "out"
    regenerate.run(stage_cfg(data, out, "engine=openai", "serve=vllm", f"target={engine_target}", "concurrency=4",
                             "dtype=float32", f"vllm.max_model_len={MAX_MODEL_LEN}", "vllm.threads=null"))
    assert answers(out) == answers(uninterrupted)  # temperature 0: the same server asked the same
    assert (out / "server.log").stat().st_size > 0 and not Path(f"{out}.work").exists()
    (server,) = started
    assert server.process is None and "--trust-remote-code" not in server.command


def test_the_server_the_stage_starts_runs_the_targets_code_when_trusted_and_holds_the_gpus(tmp_path):
    for serve, server, tp in (("sglang", "SGLang", "sglang.tp=8"), ("vllm", "vLLM", "vllm.tensor_parallel_size=8")):
        for trusted in (False, True):
            cfg = stage_cfg(tmp_path / "chats.jsonl", tmp_path / "out", "engine=openai", f"serve={serve}", tp,
                            f"target={tmp_path}", f"trust_remote_code={str(trusted).lower()}")
            command = regenerate.started_server(cfg, tmp_path / "server.log").command
            assert ("--trust-remote-code" in command) is trusted, (serve, trusted)
        held = holds(cfg, node_gpus=8)
        assert (held.gpus, held.server) == (8, f"{server}, tensor-parallel 8")
        assert holds(cfg, node_gpus=0).gpus == 0  # a CPU node
        elsewhere = stage_cfg(tmp_path / "chats.jsonl", tmp_path / "out", "engine=openai", f"serve={serve}", tp,
                              "server_url=http://192.0.2.1:30000")
        assert holds(elsewhere, node_gpus=8).gpus == 0  # a server at a URL: none started here
    assert holds(stage_cfg(tmp_path / "chats.jsonl", tmp_path / "out", "vllm.tensor_parallel_size=4"), 8).gpus == 4


def test_a_given_server_on_this_gpu_node_is_refused_before_any_work(tmp_path, monkeypatch):
    from stages.schemas import regenerate as schema

    def check(url: str) -> None:
        cfg = stage_cfg(tmp_path / "chats.jsonl", tmp_path / "out", "engine=openai", f"server_url={url}")
        schema.check_before_work(OmegaConf.to_container(cfg), "regenerate")

    check("http://127.0.0.1:30000")  # no GPU here: nothing of the pipeline's would start beside it
    monkeypatch.setattr(schema, "gpu_visible", lambda: True)
    for url in ("http://127.0.0.1:30000", "http://localhost:30000", f"http://{socket.gethostname()}:30000"):
        with pytest.raises(RegraftError, match=r"^regenerate.server_url=.*: is a server on this GPU node, .* \(fix: "
                                               r"unset regenerate.server_url and set regenerate.serve=sglang"):
            check(url)
    check("http://192.0.2.1:30000")  # another node's


def test_a_server_the_stage_would_start_needs_its_interpreter_here(tmp_path):
    from stages.schemas.regenerate import check_before_work

    def check(python: str) -> None:
        cfg = stage_cfg(tmp_path / "chats.jsonl", tmp_path / "out", "engine=openai", "serve=sglang",
                        f"sglang.python={python}")
        check_before_work(OmegaConf.to_container(cfg), "regenerate")

    check(sys.executable)
    with pytest.raises(RegraftError, match=r"^regenerate.sglang.python=/no/such/python: no such interpreter here"):
        check("/no/such/python")


def test_the_work_file_survives_a_torn_line_and_refuses_other_settings(tmp_path):
    settings = {"model": "m", "temperature": 0.0}
    log = regenerate.WorkLog(tmp_path / "work", settings)
    log.append([{"id": "a", "reason": "r"}])
    log.close()
    with (tmp_path / "work" / regenerate.WORK_FILE).open("ab") as torn:
        torn.write(b'{"id": "b", "mess')
    again = regenerate.WorkLog(tmp_path / "work", settings)
    assert list(again.records) == ["a"]
    again.append([{"id": "b", "reason": "r"}])
    again.close()
    assert [json.loads(line)["id"] for line in (tmp_path / "work" / regenerate.WORK_FILE).open()] == ["a", "b"]
    with pytest.raises(RegraftError, match="holds samples asked with other settings"):
        regenerate.WorkLog(tmp_path / "work", {**settings, "temperature": 0.7})


def test_config_rules(tmp_path):
    with pytest.raises(RegraftError, match="server_url: engine=openai needs a server .* or serve=sglang"):
        regenerate.run(stage_cfg(tmp_path / "none.jsonl", tmp_path / "out", "engine=openai"))
    with pytest.raises(RegraftError, match="target: serve=vllm needs the target model"):
        regenerate.run(stage_cfg(tmp_path / "none.jsonl", tmp_path / "out", "engine=openai", "serve=vllm"))
    with pytest.raises(RegraftError, match="extra_body: is sent to servers only"):
        regenerate.run(stage_cfg(tmp_path / "none.jsonl", tmp_path / "out", "+extra_body.top_k=5"))
    with pytest.raises(RegraftError, match="target: engine=vllm needs the target model"):
        regenerate.run(stage_cfg(tmp_path / "none.jsonl", tmp_path / "out"))
