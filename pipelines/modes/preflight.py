"""Everything regraft can check before any stage runs, in seconds: a bad value or input fails here with one line
naming it and the fix, not after an hour of upstream stages with a traceback.

- no setting holds a key, token or password, and no URL credentials (stages/common/engines/credentials.py): checked by a
  Hydra callback before `.hydra/` is written, so a refused secret reaches no file;
- every setting's bounds and cross-field rules (the schemas' `setting`s and checks, stages/common/contract/stage.py);
- the outputs and cache folders can be written, the MLflow tracking server answers;
- every input given as a path exists; chat files are not empty and start with a chat line;
- a given source drafter is a readable checkpoint (its config and tensor headers) that fits a given target (hidden
  size, vocab size where the probe needs it); draft vocab sizes fit the target vocab;
- no stage runs an MLA target (DeepSeek-V3's, Kimi-K2's layout) on vLLM's CPU build, which computes MLA attention
  wrong without a word (docs/families.md, "Who computes MLA as DeepSeek does"), on any launcher;
- an engine venv whose vLLM (or interpreter whose SGLang) is outside the versions regraft's adapters were checked
  against (stages/common/engines/engine_surface.py CHECKED) is named in one warning line, and the run goes on
  (`engine_version_warnings`, printed by pipelines/pipeline.py): users bring newer engines, and what the adapters
  reach can be checked against one with bench/engine_surface.py; a refusal would stop a run that most likely works;
- the launcher can start what the stages ask for: Slurm's commands are here (for a run, not a plan), a node has the
  GPUs each stage holds (launcher.node_gpus; locally, this machine shows them), Slurm tasks = finetune.nproc.
What needs a stage's output (a map built from data, the world's models) is checked by the stage that reads it.
"""
from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipelines.core.dag import REFERENCE, Node
from pipelines.core.registry import schema_module
from pipelines.launch.base import Launcher
from pipelines.core.data_sets import unfetched
import pipelines.schema as root_schema  # its RegraftConfig at check time: register_stage rebuilds it
from stages.common.engines.credentials import refuse_secrets
from stages.common.drafter.config import check_drafter_fits_target, target_config
from stages.common.contract.errors import RegraftError, check_room, disk_full
from stages.common.contract.stage import check_config

GIVEN_INPUTS = (("target", "path"), ("source", "path"), ("data", "train"))


def given(value: str | None) -> bool:
    """A path the user gave (not an @reference to a stage output, not `builtin`)."""
    return bool(value) and not REFERENCE.match(value) and value != "builtin"


def check_outputs_writable(cfg: DictConfig) -> None:
    """paths.outputs and paths.cache can be written and have room (else the full-disk line), before Hydra writes
    the run folder."""
    for key in ("outputs", "cache"):
        # the outputs folder is Hydra's next (the run folder goes in it); the cache is made by the first stage
        check_writable(Path(cfg.paths[key]), f"paths.{key}", keep=key == "outputs")
        check_room(Path(cfg.paths[key]))


def check_writable(folder: Path, key: str, keep: bool = True) -> None:
    """The folder exists or can be made, and a file can be written in it: else why not (a full disk, a missing or
    read-only filesystem, no permission), naming the folder and the setting that moves it. Folders made for the
    check are removed again unless `keep`: a run refused later leaves nothing behind."""
    made = [path for path in (folder, *folder.parents) if not path.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename and Path(exc.filename) != folder else ""
        raise disk_full(exc, folder) or RegraftError(folder, f"cannot be written ({exc.strerror or exc}{where})",
                                                     f"point {key}= at a folder you can write") from None
    finally:
        for path in made if not keep else []:
            with contextlib.suppress(OSError):
                path.rmdir()


def check_tracking_reachable(cfg: DictConfig, timeout_s: float = 5.0) -> None:
    """An http(s) tracking URI must answer MLflow's /health now, not after minutes of retries."""
    uri = str(cfg.tracking.uri)
    if not cfg.tracking.enabled or not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as answer:
            if answer.status == 200:
                return
            problem = f"answered HTTP {answer.status} on /health"
    except urllib.error.HTTPError as exc:
        problem = f"answered HTTP {exc.code} on /health"
    except (urllib.error.URLError, OSError) as exc:
        problem = f"does not answer ({getattr(exc, 'reason', exc)})"
    raise RegraftError(f"tracking.uri={uri}", f"no MLflow server: it {problem}",
                       "start `mlflow server` there, fix tracking.uri, or run with tracking.enabled=false")


def given_inputs(cfg: DictConfig) -> list[tuple[str, str]]:
    """(setting, path) of every input a user names: the models, the training chats, each eval set."""
    named = [(f"{group}.{key}", cfg[group][key]) for group, key in GIVEN_INPUTS]
    return named + [(f"data.eval_sets.{entry.name}", entry.path) for entry in cfg.data.eval_sets]


def check_given_inputs(cfg: DictConfig) -> None:
    # a named set a plan lists but has not fetched is left out: the run fetches it first (pipelines/core/data_sets.py)
    inputs = [(key, value) for key, value in given_inputs(cfg) if not (given(value) and unfetched(value, cfg))]
    for key, value in inputs:
        if given(value) and not Path(value).exists():
            setting = f"the path of {key}" if key.startswith("data.eval_sets.") else f"{key}="
            raise RegraftError(value, f"{key} does not exist",
                               f"point {setting} at it, or use the built-in example ({key.split('.')[0]}=toy)")
    for key, value in inputs:
        if key.startswith("data.") and given(value):
            # the training chats are learned from their assistant turns, unless the target writes them anew
            check_chat_file(Path(value), key, needs_answers=key == "data.train" and not cfg.pipeline.regenerate)


def check_chat_file(path: Path, key: str, needs_answers: bool = False) -> None:
    """Not empty, every line a chat (the first bad one named by file and line), and, `needs_answers`, some assistant
    turn with text in it. Each line is parsed here, once, where a stage job would find a bad line only on reaching
    it, after dispatch."""
    if path.is_dir():
        raise RegraftError(path, f"{key} is a folder", f"point {key}= at a JSONL file of chats")
    from stages.common.data.chat import read_chat_records  # torch: only for data given by path

    conversations = answers = 0
    for _, record in read_chat_records(path):
        conversations += 1
        answers += any(m["role"] == "assistant" and m["content"].strip() for m in record["messages"])
    if not conversations:
        raise RegraftError(path, "is empty", f"point {key}= at a JSONL file with one {{\"messages\": [...]}} per line")
    if needs_answers and not answers:
        raise RegraftError(path, f"no assistant turns in its {conversations} conversations",
                           "the chats need assistant turns, whose tokens the drafter learns; or set "
                           "pipeline.regenerate=true to have the target answer them")


def check_chat_template(cfg: DictConfig) -> None:
    """A target given by path renders chats with its tokenizer's chat template (tokenizer_config.json's
    `chat_template`, or a chat_template.jinja / .json beside it, as transformers reads them)."""
    if not given(cfg.target.path):
        return
    folder = Path(cfg.target.path)
    config = folder / "tokenizer_config.json"
    if any((folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return
    try:
        if json.loads(config.read_text()).get("chat_template"):
            return
    except (OSError, ValueError):
        pass  # no tokenizer config, or none that reads: said as no template, the tokenizer load says the rest
    raise RegraftError(folder, "its tokenizer has no chat template",
                       "add chat_template to tokenizer_config.json (or a chat_template.jinja beside it)")


def target_facts(cfg: DictConfig) -> dict | None:
    """config.json of a given target (its text part for multimodal ones), or None when a stage makes it."""
    return target_config(cfg.target.path) if given(cfg.target.path) else None


def target_vocab_size(cfg: DictConfig, facts: dict | None) -> tuple[int, str] | None:
    if facts is not None:
        return int(facts["vocab_size"]), f"{cfg.target.path}/config.json"
    if str(cfg.target.path).startswith("@world/"):
        return int(cfg.world.tokenizer_vocab_size), "world.tokenizer_vocab_size"
    return None


def check_models(cfg: DictConfig) -> None:
    facts = target_facts(cfg)
    vocab = target_vocab_size(cfg, facts)
    if vocab is not None and cfg.vocab_map.draft_vocab_size > vocab[0]:
        raise RegraftError(f"vocab_map.draft_vocab_size={cfg.vocab_map.draft_vocab_size}",
                           f"exceeds the target vocab ({vocab[0]} ids, {vocab[1]})",
                           f"set vocab_map.draft_vocab_size= to at most {vocab[0]}")
    if cfg.source.build is not None and cfg.source.build.draft_vocab_size > int(cfg.world.tokenizer_vocab_size):
        raise RegraftError(f"source.build.draft_vocab_size={cfg.source.build.draft_vocab_size}",
                           f"exceeds the built-in world's vocab ({cfg.world.tokenizer_vocab_size} ids)",
                           f"set it to at most {cfg.world.tokenizer_vocab_size}")
    if given(cfg.source.path):
        from stages.common.drafter.checkpoint import DrafterCheckpoint  # torch: only for a drafter given by path

        drafter = DrafterCheckpoint.open(cfg.source.path)  # config, tensor names, shapes and dtypes
        if facts is not None:
            check_drafter_fits_target(drafter.config, facts, cfg.source.path, cfg.target.path,
                                      same_vocab=bool(cfg.pipeline.probe))


def check_vllm_targets(node: Node) -> None:
    """The node's stage runs no MLA target on vLLM's CPU build (its schema's `check_vllm_targets`, which the stage
    run alone asks too). Asked here of every node, whatever the launcher: the engine venv, not the machine, decides
    the build (vllm_engine.cpu_build), and a Slurm job would find out only on its node, hours in, or never."""
    hooks = schema_module(node.stage)
    if hasattr(hooks, "check_vllm_targets"):
        hooks.check_vllm_targets(OmegaConf.create(OmegaConf.to_container(node.config, resolve=True,
                                                                         enum_to_str=True)), node.stage)


def engines_of(config: dict, stage: str) -> list[tuple[str, str, str]]:
    """(engine, interpreter, setting) of each engine a node's stage starts itself, from its resolved config: a
    `backend` or `engine` of vllm (its `vllm.python`), an SGLang server it starts (`sglang.python`), a states server
    (finetune's `engine`). One at a `server_url` is another's: its version cannot be read here."""
    found = []
    vllm, sglang = config.get("vllm") or {}, config.get("sglang") or {}
    chosen = {config.get("backend"), config.get("engine") if isinstance(config.get("engine"), str) else None}
    serve = config.get("serve") if config.get("engine") == "openai" and not config.get("server_url") else None
    if "vllm" in chosen or serve == "vllm":
        found.append(("vllm", vllm.get("python"), f"{stage}.vllm.python"))
    if ("sglang" in chosen and not sglang.get("server_url")) or serve == "sglang":
        found.append(("sglang", sglang.get("python"), f"{stage}.sglang.python"))
    states = config.get("engine") if isinstance(config.get("engine"), dict) else {}
    if states.get("enabled") and not states.get("server_url"):
        found.append(("vllm", (states.get("vllm") or {}).get("python"), f"{stage}.engine.vllm.python"))
    return [(engine, python, where) for engine, python, where in found if python]


def engine_version_warnings(nodes: list[Node]) -> list[str]:
    """One line per engine interpreter whose engine is outside the versions regraft's adapters were checked against
    (engine_surface.outside_checked), read from its package metadata without importing it; each interpreter once."""
    from stages.common.contract.artifacts import installed_distribution
    from stages.common.engines.engine_process import interpreter_found
    from stages.common.engines.engine_surface import outside_checked
    from stages.common.engines.vllm_engine import VllmConfig, engine_python

    lines, seen = [], set()
    for node in nodes:
        config = OmegaConf.to_container(node.config, resolve=True, enum_to_str=True)
        for engine, python, where in engines_of(config, node.name):
            path = str(engine_python(VllmConfig(python=python))) if engine == "vllm" else python
            if (engine, path) in seen or not interpreter_found(path):
                continue  # a missing interpreter is the stage's own check's to name
            seen.add((engine, path))
            found = installed_distribution(engine, path)
            line = found and outside_checked(engine, found[0], found[1], where)
            if line:
                lines.append(line)
    return lines


class BeforeRunFolder(Callback):
    """A check of the composed config before Hydra makes the run folder and writes `.hydra/` in it."""

    def check(self, config: DictConfig) -> None:
        raise NotImplementedError

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self.check(config)
        except RegraftError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(1) from None

    on_multirun_start = on_run_start


class WritableOutputs(BeforeRunFolder):
    """Hydra makes the run folder under paths.outputs before regraft's own code runs: check it can first."""

    def check(self, config: DictConfig) -> None:
        check_outputs_writable(config)


class NoSecrets(BeforeRunFolder):
    """Hydra writes every setting and override into `.hydra/`: a key given as one is refused before that."""

    def check(self, config: DictConfig) -> None:
        refuse_secrets(config)


def checks_before_any_work(cfg: DictConfig, nodes: list[Node], launcher: Launcher,
                           planning: bool = False) -> list[Callable[[], None]]:
    """Every check above, cheapest first, each raising a RegraftError. `planning`: for pipeline.plan, which submits
    nothing (so needs no Slurm commands here)."""
    checks: list[Callable[[], None]] = [
        lambda: refuse_secrets(cfg), lambda: check_config(cfg, root_schema.RegraftConfig, ""),
        lambda: launcher.check_machine(planning), lambda: check_outputs_writable(cfg),
        lambda: check_tracking_reachable(cfg), lambda: check_given_inputs(cfg), lambda: check_chat_template(cfg),
        lambda: check_models(cfg)]
    checks += [lambda node=node: check_vllm_targets(node) for node in nodes]
    for node in nodes:
        checks.append(lambda node=node: launcher.check(node, OmegaConf.to_container(node.config, resolve=True,
                                                                                     enum_to_str=True)))
    return checks


def check_before_any_work(cfg: DictConfig, nodes: list[Node], launcher: Launcher) -> None:
    """Raises the first RegraftError of the checks above."""
    for check in checks_before_any_work(cfg, nodes, launcher):
        check()


def problems_before_any_work(cfg: DictConfig, nodes: list[Node], launcher: Launcher) -> list[str]:
    """Every problem the checks above find, each once (pipeline.plan lists them all). A check that breaks for
    another reason after a problem was found is that problem's knock-on, and is left out."""
    found: list[str] = []
    for check in checks_before_any_work(cfg, nodes, launcher, planning=True):
        try:
            check()
        except RegraftError as exc:
            if str(exc) not in found:
                found.append(str(exc))
        except Exception:  # noqa: BLE001 (see above)
            if not found:
                raise
    return found
