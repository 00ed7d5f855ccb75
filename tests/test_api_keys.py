"""Servers behind a key (issue 23 §6): the key comes from the environment only (REGRAFT_API_KEY, or the variable
`api_key_env` names), goes to the server as a bearer token, and is written nowhere; a key given as a setting is
refused with one line before anything is written; a refused key ends the stage at once, naming the variable.

Against a real `vllm.entrypoints.openai.api_server --api-key` (one for the module, tests/servers.py) regraft
runs as a user runs it, `python -m pipelines.regraft` with pipeline.regenerate on, and every file under the outputs
(cache, run folder with `.hydra/` and job logs, the MLflow store) is searched for the key. The client's header,
its refusals and SGLang's probe client are checked against small stand-ins without an engine.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stages import regenerate
from stages.common.engines.credentials import DEFAULT_KEY_ENV
from stages.common.drafter.config import drafter_config_for
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.errors import RegraftError
from stages.common.engines.openai_client import request_json, served_models
from stages.common.contract.stage import compose_stage
from tests.conftest import random_map
from tests.test_probe_sglang import probe, record, standin_cfg  # noqa: F401 (record: the stand-in's fixture)
from tests.servers import HOST, REPO, needs_engine, reply, vllm_server

SECRET = f"regraft-test-key-{secrets.token_hex(16)}"
WRONG = f"regraft-wrong-key-{secrets.token_hex(16)}"
USERS = "alpha bravo charlie kilo lima mike".split()


def chats(path: Path, count: int = 8) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": USERS[i % 6]},
                                                     {"role": "assistant", "content": "the old answer"}]}) + "\n"
                            for i in range(count)))
    return path


def files_holding(root: Path, *needles: str) -> dict[str, list[str]]:
    """Every file under `root` (hidden ones and folders included), by needle: those whose bytes hold it."""
    found: dict[str, list[str]] = {needle: [] for needle in needles}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            for needle in needles:
                if needle.encode() in data:
                    found[needle].append(str(path.relative_to(root)))
    return found


def lines_of(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.strip()]


# --- regraft against a real vLLM server run with --api-key ------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server(engine_target, tmp_path_factory):
    log = tmp_path_factory.mktemp("keyed_server") / "server.log"
    with vllm_server(engine_target, log, "--api-key", SECRET) as url:
        yield url, log


@pytest.fixture(scope="module")
def given(engine_target, vocab_size, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("api_keys")
    drafter = Eagle3Drafter.initialised(drafter_config_for(engine_target, 64), random_map(vocab_size, 64, 0))
    return {"target": engine_target, "drafter": drafter.save(root / "drafter"), "chats": chats(root / "chats.jsonl")}


Run = tuple[subprocess.CompletedProcess, float]  # what regraft printed, and how long it took


def regraft(outputs: Path, given: dict[str, Path], url: str, key: str) -> Run:
    """regenerate on the server with `key` in REGRAFT_API_KEY, then the least pipeline that trains on its answers
    (vocab_map, compare, remap, a two-step online fine-tune), each a job of the local launcher; MLflow in outputs."""
    env = {**os.environ, DEFAULT_KEY_ENV: key}
    command = [sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", "source.build=null",
               f"target.path={given['target']}", f"source.path={given['drafter']}", f"data.train={given['chats']}",
               "pipeline.regenerate=true", "regenerate.engine=openai", f"regenerate.server_url={url}",
               "regenerate.max_tokens=16", "regenerate.concurrency=4", "pipeline.probe=false",
               "pipeline.diagnose=false", "pipeline.baseline=false", "pipeline.evaluate=false",
               "pipeline.offline=false", "vocab_map.draft_vocab_size=64", "finetune.max_steps=2",
               "finetune.micro_batch_size=4", "finetune.max_length=48", "finetune.ttt_steps=2"]
    start = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    return done, time.monotonic() - start


def refusals(log: Path) -> int:
    """The requests the server answered 401 (uvicorn's access log)."""
    return sum(" 401 " in line for line in log.read_text(errors="replace").splitlines())


@needs_engine
def test_the_key_from_the_environment_is_sent_and_written_nowhere(keyed_server, given, tmp_path):
    url, _ = keyed_server
    done, _ = regraft(tmp_path, given, url, SECRET)
    assert done.returncode == 0, lines_of(done)[-5:]
    regenerated = next(tmp_path.glob("cache/regenerate/*/regenerated.jsonl"))
    assert len(regenerated.read_text().splitlines()) == 8  # the server answered every sample: the key was taken
    written = [str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file()]
    for kind in ("/.hydra/config.yaml", "/.hydra/overrides.yaml", "/.hydra/hydra.yaml", "regraft.log", "mlflow.db",
                 "/manifest.json", "_log.out", "_log.err", "_submitted.pkl", "_result.pkl", "summary.json"):
        assert any(kind in name or name.endswith(kind) for name in written), (kind, written)
    assert any("mlartifacts/" in name for name in written)
    assert files_holding(tmp_path, SECRET) == {SECRET: []}
    assert SECRET not in done.stdout


@needs_engine
def test_a_wrong_key_ends_the_stage_at_once_naming_the_variable(keyed_server, given, tmp_path):
    url, log = keyed_server
    before = refusals(log)
    done, _ = regraft(tmp_path, given, url, WRONG)
    lines = lines_of(done)
    assert done.returncode == 1, lines[-5:]
    assert lines[-2].startswith(f"error: regenerate: {DEFAULT_KEY_ENV} was refused by {url}/v1/models (HTTP 401"), \
        lines[-3:]
    assert "(fix: export REGRAFT_API_KEY with the key the server was started with (--api-key)" in lines[-2]
    assert lines[-1].startswith("log: ") and "Traceback" not in done.stdout
    assert refusals(log) - before == 1  # asked once, never again
    assert not list(tmp_path.glob("cache/regenerate/*/manifest.json"))
    assert files_holding(tmp_path, WRONG, SECRET) == {WRONG: [], SECRET: []}


@needs_engine
def test_the_client_reads_the_variable_api_key_env_names_and_says_when_none_is_set(keyed_server, engine_target,
                                                                                   monkeypatch):
    url, _ = keyed_server
    monkeypatch.delenv(DEFAULT_KEY_ENV, raising=False)
    monkeypatch.setenv("MY_SERVERS_KEY", SECRET)
    assert served_models(url, 30, key_env="MY_SERVERS_KEY") == [str(engine_target)]
    with pytest.raises(RegraftError) as unset:
        served_models(url, 30, retries=3)
    assert str(unset.value).startswith(f"{url}/v1/models wants a key (HTTP 401") and \
        f"and {DEFAULT_KEY_ENV} is not set (fix: export {DEFAULT_KEY_ENV}=" in str(unset.value)


# --- a key given as a setting: refused before anything is written ------------------------------------------------

GIVEN_AS_SETTINGS = [
    ("regenerate.api_key", [f"regenerate.api_key={SECRET}"], "regenerate.api_key: a key, token or password is never "
     "a setting"),
    ("a secret inside extra_body", [f"+regenerate.extra_body.token={SECRET}"], "regenerate.extra_body.token: a key"),
    ("credentials in tracking.uri", [f"tracking.uri=http://alice:{SECRET}@127.0.0.1:5000"],
     "tracking.uri: holds credentials (user:password@ in the URL)"),
    ("a key where its variable's name goes", [f"regenerate.api_key_env=sk-{SECRET}"],
     "regenerate.api_key_env: is not the name of an environment variable"),
]


@pytest.mark.parametrize("case, overrides, says", GIVEN_AS_SETTINGS, ids=[c[0] for c in GIVEN_AS_SETTINGS])
def test_a_key_given_as_a_setting_is_refused_with_one_line(tmp_path, case, overrides, says):
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={tmp_path / 'out'}",
                           *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    lines = lines_of(done)
    assert done.returncode == 1 and len(lines) == 1, lines[-5:]
    assert lines[0].startswith(f"error: {says}") and "(fix: " in lines[0], lines
    assert SECRET not in done.stdout  # the line names the setting, never its value
    assert not (tmp_path / "out").exists()  # refused before Hydra made the run folder: no .hydra/, no store


def test_the_stage_alone_refuses_a_key_as_a_setting(tmp_path):
    done = subprocess.run([sys.executable, "-m", "stages.regenerate", f"data={tmp_path / 'none.jsonl'}",
                           f"out={tmp_path / 'out'}", "engine=openai", "server_url=http://127.0.0.1:9",
                           f"api_key={SECRET}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert done.returncode == 1 and lines_of(done) == [
        "error: api_key: a key, token or password is never a setting: regraft would write it into .hydra/, "
        "manifests and MLflow (fix: drop api_key= and export the key in an environment variable (REGRAFT_API_KEY, "
        "or the one api_key_env= names))"]


# --- the clients against stand-ins: the header, a refusal mid-run, SGLang's probe client --------------------------

class KeyedServer(BaseHTTPRequestHandler):
    """An OpenAI-style stand-in that wants `Bearer SECRET`; `refuse_chats` answers 401 to every chat request."""

    seen: list[tuple[str, str | None]] = []  # (path, Authorization header) of every request
    refuse_chats = False

    def do_GET(self) -> None:
        self.answer({"data": [{"id": "m"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer({"choices": [{"message": {"content": "an answer"}, "finish_reason": "stop"}],
                     "usage": {"completion_tokens": 2}})

    def answer(self, body: dict) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/v1/moved":  # a redirect: the key must not follow it
            reply(self, 307, b"", Location="/v1/models")
            return
        keyed = self.headers.get("Authorization") == f"Bearer {SECRET}"
        status = 401 if not keyed or (self.refuse_chats and self.command == "POST") else 200
        reply(self, status, json.dumps(body if status == 200 else {"error": "Unauthorized"}).encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def keyed_standin():
    KeyedServer.seen, KeyedServer.refuse_chats = [], False
    server = ThreadingHTTPServer((HOST, 0), KeyedServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{HOST}:{server.server_port}"
    server.shutdown()


def test_the_client_sends_the_key_as_a_bearer_token_and_never_on_a_redirect(keyed_standin, monkeypatch):
    monkeypatch.setenv(DEFAULT_KEY_ENV, SECRET)
    assert served_models(keyed_standin, 10) == ["m"]
    assert KeyedServer.seen == [("/v1/models", f"Bearer {SECRET}")]
    monkeypatch.setenv(DEFAULT_KEY_ENV, "")  # set but empty: no header at all
    with pytest.raises(RegraftError, match=f"wants a key \\(HTTP 401: Unauthorized\\) and {DEFAULT_KEY_ENV} is not"):
        served_models(keyed_standin, 10)
    assert KeyedServer.seen[-1] == ("/v1/models", None)
    monkeypatch.setenv(DEFAULT_KEY_ENV, SECRET)
    with pytest.raises(RegraftError, match=f"{DEFAULT_KEY_ENV} was refused by .*/v1/moved"):
        request_json(f"{keyed_standin}/v1/moved", None, 10, retries=3)
    assert KeyedServer.seen[-2:] == [("/v1/moved", f"Bearer {SECRET}"), ("/v1/models", None)]


def test_a_key_refused_mid_run_ends_the_stage_at_once_and_rejects_nothing(keyed_standin, monkeypatch, tmp_path):
    monkeypatch.setenv(DEFAULT_KEY_ENV, SECRET)
    KeyedServer.refuse_chats = True  # /v1/models answers, the first chat request is refused (a key revoked)
    data = chats(tmp_path / "chats.jsonl", count=6)
    cfg = compose_stage("regenerate", [f"data={data}", f"out={tmp_path / 'out'}", "engine=openai",
                                       f"server_url={keyed_standin}", "concurrency=1", "retries=5"])
    start = time.monotonic()
    with pytest.raises(RegraftError, match=f"^{DEFAULT_KEY_ENV} was refused by {keyed_standin}/v1/chat/completions "
                                           r"\(HTTP 401: Unauthorized\) \(fix: export "):
        regenerate.run(cfg)
    assert time.monotonic() - start < 5  # retries=5 would pause 1+2+4+8+16 s: none was taken
    paths = [path for path, _ in KeyedServer.seen]  # each chat request in flight asked once, none again
    assert paths[0] == "/v1/models" and set(paths[1:]) == {"/v1/chat/completions"} and len(paths) <= 3, paths
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out.work" / regenerate.WORK_FILE).read_text()  # no sample marked rejected


def test_the_sglang_probe_client_sends_the_key_and_stops_at_a_refused_one(record, monkeypatch, tmp_path):
    keyed = standin_cfg(extra_args=["--api-key", SECRET])
    monkeypatch.setenv(DEFAULT_KEY_ENV, SECRET)
    rows = probe(keyed, tmp_path / "right.log", [["hi there"]])
    assert len(rows) == 1 and rows[0]["completion_tokens"] > 0
    assert json.loads(record.read_text())["unauthorized"] == 0
    monkeypatch.setenv(DEFAULT_KEY_ENV, WRONG)
    with pytest.raises(RegraftError, match=f"^{DEFAULT_KEY_ENV} was refused by http://.*/flush_cache \\(HTTP 401"):
        probe(keyed, tmp_path / "wrong.log")
    assert json.loads(record.read_text())["unauthorized"] == 1
