"""A TEST STAND-IN for an SGLang server (SGLang itself cannot run on a CPU-only machine): no model, stdlib only.

It accepts `python -m sglang.launch_server`'s flags as `stages.common.engines.sglang_backend.server_command` builds them
(unknown extras are ignored), so the real lifecycle (Popen, process group, /health polling, stop) is exercised:

    python -m tests.sglang_standin --model-path T --speculative-algorithm EAGLE3 ... --host H --port P

Endpoints: `GET /health` (503 until `--standin-startup-delay` s have passed, then 200), `POST /flush_cache`,
`POST /generate`, `GET /get_server_info` (what was recorded). A hand-checkable /generate rule:
  words = text.split(); completion_tokens = min(max_new_tokens, len(words)); prompt_tokens = len(words);
  answer = the first completion_tokens words, reversed; spec_verify_ct = ceil(completion_tokens / accept),
  `accept` = `--standin-accept` (default 2.0); without `--speculative-algorithm` spec_verify_ct is omitted.
`REGRAFT_STANDIN_RECORD=path` makes it write {argv, executable, pid, child_pid, flush_cache, generate: [texts]}
there as JSON at start and after every request.
Test-only flags: `--standin-fail MESSAGE` (print it, exit 1 at startup), `--standin-ignore-sigterm`,
`--standin-spawn-child` (a sleeping child in the same process group, as SGLang's scheduler processes are),
`--standin-crash-after N` (exit 3 on the generate request after the first N).
`--api-key KEY`, as SGLang's: every route but /health answers 401 without `Authorization: Bearer KEY` (counted in
the record's `unauthorized`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RECORD_ENV = "REGRAFT_STANDIN_RECORD"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sglang_standin")
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--speculative-algorithm")
    parser.add_argument("--speculative-draft-model-path")
    parser.add_argument("--speculative-num-steps", type=int)
    parser.add_argument("--speculative-eagle-topk", type=int)
    parser.add_argument("--speculative-num-draft-tokens", type=int)
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key")
    parser.add_argument("--standin-accept", type=float, default=2.0)
    parser.add_argument("--standin-startup-delay", type=float, default=0.0)
    parser.add_argument("--standin-fail")
    parser.add_argument("--standin-ignore-sigterm", action="store_true")
    parser.add_argument("--standin-spawn-child", action="store_true")
    parser.add_argument("--standin-crash-after", type=int, default=-1)
    return parser.parse_known_args(argv)[0]


class State:
    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args = args
        self.ready_at = time.monotonic() + args.standin_startup_delay
        self.lock = threading.Lock()
        self.record = {"argv": argv, "executable": sys.executable, "module_file": __file__, "pid": os.getpid(),
                       "child_pid": None, "flush_cache": 0, "generate": [], "unauthorized": 0}

    def note(self, key: str, text: str | None = None) -> None:
        """Count a flush or keep a generate request's text, then save the record."""
        with self.lock:
            if text is None:
                self.record[key] += 1
            else:
                self.record[key].append(text)
            self.save()

    def save(self) -> None:
        path = os.environ.get(RECORD_ENV)
        if path:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as out:
                json.dump(self.record, out)
            os.replace(tmp, path)


def answer(state: State, text: str, max_new_tokens: int) -> dict:
    words = text.split()
    completion = min(max_new_tokens, len(words))
    meta = {"id": str(len(state.record["generate"])), "finish_reason": {"type": "length"},
            "prompt_tokens": len(words), "completion_tokens": completion, "cached_tokens": 0}
    if state.args.speculative_algorithm:
        meta["spec_verify_ct"] = math.ceil(completion / state.args.standin_accept)
    return {"text": " ".join(reversed(words[:completion])), "meta_info": meta}


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: object = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            """SGLang's middleware with --api-key: /health is open, everything else wants the bearer token."""
            key = state.args.api_key
            if not key or self.path.startswith("/health") or self.headers.get("Authorization") == f"Bearer {key}":
                return False
            state.note("unauthorized")
            self._send(401, {"error": "Unauthorized"})
            return True

        def do_GET(self) -> None:
            if self._refused():
                return
            if self.path == "/health":
                self._send(200 if time.monotonic() >= state.ready_at else 503)
            elif self.path == "/get_server_info":
                self._send(200, state.record)
            else:
                self._send(404, {"message": f"no route {self.path}"})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self._refused():
                return
            if self.path == "/flush_cache":
                state.note("flush_cache")
                self._send(200)
            elif self.path == "/generate":
                try:
                    request = json.loads(body)
                    text, params = request["text"], request.get("sampling_params") or {}
                    out = answer(state, text, int(params.get("max_new_tokens", 128)))
                except (ValueError, KeyError, TypeError) as exc:
                    self._send(400, {"object": "error", "message": f"bad request: {exc}", "code": 400})
                    return
                state.note("generate", text)
                if len(state.record["generate"]) > state.args.standin_crash_after >= 0:
                    print("standin: crashed (CUDA out of memory)", file=sys.stderr, flush=True)
                    os._exit(3)
                self._send(200, out)
            else:
                self._send(404, {"message": f"no route {self.path}"})

    return Handler


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    state = State(args, argv)
    if args.standin_fail:
        print(f"standin: {args.standin_fail}", file=sys.stderr, flush=True)
        return 1
    if args.standin_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.standin_spawn_child:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        state.record["child_pid"] = child.pid
    state.save()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    server.daemon_threads = True
    print(f"standin: serving {args.model_path} on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
