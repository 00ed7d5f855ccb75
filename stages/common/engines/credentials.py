"""Keys for servers: taken from the environment only, and never written anywhere.

A server regraft talks to by URL (an OpenAI-compatible one for regenerate, SGLang's for the probe) may run with
`--api-key`: the key is read from the environment variable a setting names (`api_key_env`, default
`REGRAFT_API_KEY`: regraft's own, so a key meant for another service, OPENAI_API_KEY say, never goes to a server by
default) and sent as `Authorization: Bearer <key>`, as vLLM, SGLang and OpenAI expect; unset or empty, no header is
sent. The key itself is never a setting: one would be written into Hydra's `.hydra/`, the stage manifests and
MLflow's params. So a setting named like a secret (api_key, token, password, secret, ...) that holds a value, or a
URL with credentials in it (http://user:pass@host), is refused with one line naming the setting, never its value.
MLflow reads its own credentials (MLFLOW_TRACKING_USERNAME, _PASSWORD, _TOKEN) from the environment.
"""
from __future__ import annotations

import os
import re
import urllib.request
from dataclasses import asdict, is_dataclass
from typing import Any, Iterator
from urllib.parse import urlsplit

from stages.common.contract.errors import RegraftError

DEFAULT_KEY_ENV = "REGRAFT_API_KEY"
UNAUTHORIZED = (401, 403)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# a setting's own name (the last part of its dotted key), lower case, '-' read as '_'
SECRET_NAME = re.compile(r"(^|_)(api_?key|access_?key|private_?key|secret(_?key)?|password|passwd|token|"
                         r"credentials?|authorization)$")
TRACKING_FIX = ("drop them from the URI: MLflow reads MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN) from the environment itself")


def check_key_env(name: str, setting: str) -> None:
    """`api_key_env` names a variable; its value is never echoed (it may be the key, put in the wrong place)."""
    if not ENV_NAME.match(str(name)):
        raise RegraftError(setting, "is not the name of an environment variable (letters, digits and _)",
                           f"set {setting}= to the variable's name, e.g. {DEFAULT_KEY_ENV}, and export the key "
                           "in it; the key itself is never a setting")


def api_key(env: str) -> str | None:
    return os.environ.get(env, "").strip() or None


def authorize(request: urllib.request.Request, env: str) -> urllib.request.Request:
    """The key in `env`, if set, as a bearer token; not sent on to wherever a redirect points."""
    key = api_key(env)
    if key:
        request.add_unredirected_header("Authorization", f"Bearer {key}")
    return request


def refused_key(env: str, url: str, status: int, message: str) -> RegraftError:
    """What a 401/403 means: the key (or its absence) is wrong; asking again cannot help."""
    answer = f"HTTP {status}" + (f": {message}" if message else "")
    if api_key(env):
        return RegraftError(None, f"{env} was refused by {url} ({answer})",
                            f"export {env} with the key the server was started with (--api-key), or set "
                            "api_key_env= to the variable that holds it")
    return RegraftError(None, f"{url} wants a key ({answer}) and {env} is not set",
                        f"export {env}=<the server's --api-key>, or set api_key_env= to the variable that holds it")


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name.lower().replace("-", "_")))


def url_credentials(value: str) -> bool:
    """A URL with a password in it, or any user part in an http(s) one (a token given as the user)."""
    if "://" not in value or "@" not in value:
        return False
    try:
        parts = urlsplit(value.strip())
    except ValueError:
        return False
    return parts.password is not None or (parts.scheme in ("http", "https") and parts.username is not None)


def walk(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of plain containers."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from walk(inner, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for index, inner in enumerate(value):
            yield from walk(inner, f"{where}[{index}]")
    else:
        yield where, value


def refuse_secrets(config: Any, where: str = "") -> None:
    """No setting of `config` (an OmegaConf config, read unresolved, a dataclass or plain containers) holds a
    secret: one line naming the first that does (never its value), and how to give it instead. Hydra's `overrides`
    lists are read as the `key=value` overrides they are, so a sweep's values are checked too; an `api_key_env`
    must name a variable."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(config):
        config = OmegaConf.to_container(config, resolve=False)
    elif is_dataclass(config) and not isinstance(config, type):
        config = asdict(config)
    for key, value in walk(config, where):
        if key.startswith("hydra.overrides.") and isinstance(value, str):
            key, _, value = value.lstrip("+~").partition("=")
            value = None if value.strip() in ("", "null") else value
        name = re.split(r"[./]", re.sub(r"\[\d+\]$", "", key))[-1]
        if is_secret_name(name) and value not in (None, "") and not isinstance(value, bool):
            raise_secret_setting(key)
        if name.endswith("key_env"):
            check_key_env(value, key)
        if isinstance(value, str) and url_credentials(value):
            fix = TRACKING_FIX if key.endswith("tracking.uri") else \
                f"drop them from the URL, and export the key in {DEFAULT_KEY_ENV} (or the variable api_key_env names)"
            raise RegraftError(key, "holds credentials (user:password@ in the URL), which regraft would write into "
                               ".hydra/, manifests and MLflow", fix)


def raise_secret_setting(key: str) -> None:
    raise RegraftError(key, "a key, token or password is never a setting: regraft would write it into .hydra/, "
                       "manifests and MLflow", f"drop {key}= and export the key in an environment variable "
                       f"({DEFAULT_KEY_ENV}, or the one api_key_env= names)")
