"""A client for any OpenAI-compatible chat server (vLLM's `vllm serve`, SGLang's `launch_server`, ...):
`GET /v1/models` and `POST /v1/chat/completions`, standard library only, safe to call from many threads.

Three kinds of failure, kept apart because a caller treats them differently:
- the server refuses the request itself (HTTP 4xx other than 401/403/408/429: a prompt past its context length, a
  message it cannot render): `Refused`, carrying the server's own message, for the caller to record against it;
- the server cannot answer (connection refused or reset, timeout, 5xx, 408, 429): retried `retries` times with a
  doubling pause, then one RegraftError, so a dead server stops the caller instead of refusing everything;
- the server refuses the key (HTTP 401/403, from a server run with `--api-key`): one RegraftError at once, naming the
  variable, never retried (stages/common/engines/credentials.py: the key comes from the variable `key_env` names).

    answer = chat_completion(url, {"model": "m", "messages": [...], "max_tokens": 16}, timeout=60, retries=3)
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from stages.common.engines.credentials import DEFAULT_KEY_ENV, UNAUTHORIZED, authorize, refused_key
from stages.common.contract.errors import RegraftError

RETRY_PAUSE_S = 1.0  # the first pause between tries; it doubles each time
TRANSIENT_STATUS = (408, 429)  # 4xx that say "later", not "never"


@dataclass
class ChatAnswer:
    text: str  # the answer's content ("" when the server sent none)
    finish_reason: str | None  # stop | length | ...
    completion_tokens: int  # the server's usage count
    reasoning: str | None = None  # reasoning_content, from servers run with a reasoning parser


class Refused(Exception):
    """The server refused this request as bad (HTTP 4xx): the request's fault, not the server's."""

    def __init__(self, status: int, message: str):
        self.status, self.message = status, message
        super().__init__(f"HTTP {status}: {message}")


def error_message(raw: bytes) -> str:
    """The message of an error body ({"error": {"message": ...}}, {"message": ...} or {"error": "..."}) on one line."""
    try:
        body = json.loads(raw)
        error = body.get("error")
        inner = error if isinstance(error, dict) else body
        text = str(inner.get("message") or (error if isinstance(error, str) else body))
    except (ValueError, AttributeError):
        text = raw.decode(errors="replace")
    return " ".join(text.split())[:500]


def request_json(url: str, payload: dict | None, timeout: float, retries: int,
                 key_env: str = DEFAULT_KEY_ENV) -> dict:
    """GET (no payload) or POST JSON, the answer parsed; see the module docstring for the failures."""
    data = None if payload is None else json.dumps(payload).encode()
    request = authorize(urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                               headers={"Content-Type": "application/json"}), key_env)
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            message = error_message(exc.read())
            if exc.code in UNAUTHORIZED:
                raise refused_key(key_env, url, exc.code, message) from None
            if exc.code < 500 and exc.code not in TRANSIENT_STATUS:
                raise Refused(exc.code, message) from None
            problem = f"HTTP {exc.code}: {message}"
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        if attempt < retries:
            time.sleep(RETRY_PAUSE_S * 2 ** attempt)
    raise RegraftError(url, f"no answer after {retries + 1} tries ({problem})",
                       "check that the server runs and read its log; raise the request timeout if it is slow")


def served_models(url: str, timeout: float, retries: int = 0, key_env: str = DEFAULT_KEY_ENV) -> list[str]:
    """The model names `GET /v1/models` lists."""
    try:
        listed = request_json(f"{url}/v1/models", None, timeout, retries, key_env)
        return [str(model["id"]) for model in listed["data"]]
    except Refused as exc:
        raise RegraftError(f"{url}/v1/models", f"refused ({exc})", "point server_url at an OpenAI-compatible "
                           "server (http://host:port, no /v1)") from None
    except (KeyError, TypeError) as exc:
        raise RegraftError(f"{url}/v1/models", f"not an OpenAI model list ({exc})",
                           "point server_url at an OpenAI-compatible server (http://host:port, no /v1)") from None


def chat_completion(url: str, payload: dict, timeout: float, retries: int,
                    key_env: str = DEFAULT_KEY_ENV) -> ChatAnswer:
    """One `POST /v1/chat/completions` (non-streaming); `Refused` when the server rejects the request."""
    answer = request_json(f"{url}/v1/chat/completions", payload, timeout, retries, key_env)
    try:
        choice = answer["choices"][0]
        message = choice["message"]
        usage = answer.get("usage") or {}
        return ChatAnswer(text=message.get("content") or "", finish_reason=choice.get("finish_reason"),
                          completion_tokens=int(usage.get("completion_tokens") or 0),
                          reasoning=message.get("reasoning_content") or message.get("reasoning"))
    except (KeyError, IndexError, TypeError) as exc:
        raise RegraftError(f"{url}/v1/chat/completions", f"not a chat completion: {str(answer)[:200]}",
                           "point server_url at an OpenAI-compatible server") from exc
