"""Eval sets and training data by name: `data.eval_sets=[mtbench, humaneval, gsm8k, math500]`, `data.train=sharegpt`.

A set is given one of four ways, and `describe` turns each into a `SetSpec`:
- a name from `NAMED` below (`mtbench`): the hub dataset the field measures on or trains from;
- a path (a chat JSONL, `builtin`, an `@stage/...` output): read as it always was;
- `{name, path}`: the same, named (`accept_len/<name>`);
- `{name, dataset, split, subset, format, column, limit}`: a hub id or a local folder (a `save_to_disk` folder, or
  the hub's own file layout), read with Hugging Face `datasets`; a known name fills what is left out, so
  `{name: gsm8k, dataset: /copies/gsm8k}` is GSM8K from a local copy.

`materialise` loads a dataset set once through `datasets` (its cache; `HF_DATASETS_OFFLINE=1` honoured by `datasets`
itself) and writes it as regraft's chat JSONL under `<cache>/datasets/<name>-<key>/chats.jsonl`, keyed by what it was
made from, so every stage keeps reading JSONL. An eval set keeps only the user turns (the probe asks them turn by
turn on the conversation so far, as SpecForge's MT-Bench benchmark asks both turns); training data keeps user and
assistant turns. `limit` keeps the first rows in the dataset's order (SpecForge's `--sample-size`).

    spec = describe("gsm8k", "data.eval_sets")
    path = materialise(spec, Path("outputs/cache"), eval_set=True)   # .../datasets/gsm8k-<key>/chats.jsonl
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from stages.common.contract.errors import RegraftError

VERSION = 1  # bump when a conversion changes: every materialised set is made again


@dataclass(frozen=True)
class SetSpec:
    name: str
    path: Optional[str] = None  # a chat JSONL, builtin or an @reference: read as it is
    dataset: Optional[str] = None  # a hub id or a local folder, read with `datasets`
    subset: Optional[str] = None  # the dataset's config name (GSM8K's `main`)
    split: str = "train"
    format: str = "text"  # how a row becomes turns: FORMATS
    column: Optional[str] = None  # the column FORMATS reads (each has its default)
    limit: Optional[int] = None  # the first `limit` rows, in the dataset's order
    source: str = ""  # where the choice comes from (NAMED)


# The sets the field reports and trains on. Each entry says whose code it follows; docs/data.md has the table.
NAMED: dict[str, SetSpec] = {
    # SpecForge benchmarks/run_mtbench.py and benchmarker/mtbench.py read FastChat's question.jsonl (`turns`, two
    # user turns, both asked); the same 80 questions on the hub are HuggingFaceH4/mt_bench_prompts, split train,
    # column `prompt` (NeMo Automodel components/speculative/bench_sweep.py DEFAULT_DATASET_PRESETS names this id).
    "mtbench": SetSpec("mtbench", dataset="HuggingFaceH4/mt_bench_prompts", split="train", format="turns",
                       source="SpecForge benchmarks/run_mtbench.py; NeMo Automodel bench_sweep.py"),
    # SpecForge benchmarks/run_humaneval.py: load_dataset("openai/openai_humaneval")["test"], `prompt` as the user
    # turn; NeMo Automodel bench_sweep.py the same (prompt_column=prompt)
    "humaneval": SetSpec("humaneval", dataset="openai/openai_humaneval", split="test", column="prompt",
                         source="SpecForge benchmarks/run_humaneval.py; NeMo Automodel bench_sweep.py"),
    # NeMo Automodel bench_sweep.py: openai/gsm8k, dataset_name main, split test, `question`; SpecForge
    # benchmarker/gsm8k.py reads the same test file from openai/grade-school-math (and adds 5-shot turns, left out)
    "gsm8k": SetSpec("gsm8k", dataset="openai/gsm8k", subset="main", split="test", column="question",
                     source="NeMo Automodel bench_sweep.py; SpecForge benchmarks/benchmarker/gsm8k.py"),
    # SpecForge benchmarks/benchmarker/math500.py: load_dataset("HuggingFaceH4/MATH-500")["test"], `problem`
    "math500": SetSpec("math500", dataset="HuggingFaceH4/MATH-500", split="test", column="problem",
                       source="SpecForge benchmarks/benchmarker/math500.py"),
    # SpecForge scripts/prepare_data.py --dataset sharegpt: Aeala/ShareGPT_Vicuna_unfiltered, split train,
    # `conversations` of {from, value}; human -> user, gpt/chatgpt/bing/bard -> assistant, any other turn dropped
    "sharegpt": SetSpec("sharegpt", dataset="Aeala/ShareGPT_Vicuna_unfiltered", split="train", format="sharegpt",
                        source="SpecForge scripts/prepare_data.py (process_sharegpt_row)"),
    # SpecForge scripts/prepare_data.py --dataset ultrachat: HuggingFaceH4/ultrachat_200k, split train_sft,
    # `messages` of {role, content}
    "ultrachat": SetSpec("ultrachat", dataset="HuggingFaceH4/ultrachat_200k", split="train_sft", format="messages",
                         source="SpecForge scripts/prepare_data.py (process_ultrachat_row)"),
}

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant", "assistant": "assistant"}  # SpecForge prepare_data.py ROLE_MAPPING


def turns_of(row: dict, column: str | None) -> list[dict]:
    """A list of user turns (MT-Bench): the hub's `prompt`, or FastChat's `turns`."""
    key = column or next((name for name in ("prompt", "turns") if name in row), "prompt")
    value = row[key]
    return [{"role": "user", "content": str(text)} for text in ([value] if isinstance(value, str) else value) if text]


def text_of(row: dict, column: str | None) -> list[dict]:
    """One column of text as one user turn (HumanEval's `prompt`, GSM8K's `question`, MATH-500's `problem`)."""
    if column is None:
        raise KeyError("format text needs a column")
    return [{"role": "user", "content": str(row[column])}] if row[column] else []


def sharegpt_of(row: dict, column: str | None) -> list[dict]:
    return [{"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]} for turn in row[column or "conversations"]
            if turn.get("from") in SHAREGPT_ROLES and isinstance(turn.get("value"), str)]


def messages_of(row: dict, column: str | None) -> list[dict]:
    return [{"role": turn["role"], "content": turn["content"]} for turn in row[column or "messages"]
            if turn.get("role") in ("system", "user", "assistant") and isinstance(turn.get("content"), str)]


FORMATS: dict[str, Callable[[dict, Optional[str]], list[dict]]] = {
    "turns": turns_of, "text": text_of, "sharegpt": sharegpt_of, "messages": messages_of}
FIELDS = {"name", "path", "dataset", "subset", "split", "format", "column", "limit"}


def known_names() -> str:
    return ", ".join(NAMED)


def describe(entry: Any, key: str) -> SetSpec:
    """What one `data.eval_sets` entry or `data.train` is; an unknown name or field is one line naming the known
    ones. `key` is the setting, as the user writes it."""
    if hasattr(entry, "items"):  # a mapping (a DictConfig or a dict)
        given = {field: value for field, value in entry.items() if value is not None}
        unknown = sorted(set(given) - FIELDS)
        if unknown or "name" not in given:
            raise RegraftError(key, f"a set takes {', '.join(sorted(FIELDS))}; got {', '.join(map(str, given))}",
                               "give {name, path} for a chat JSONL, or {name, dataset, split, ...} for a dataset")
        name = str(given["name"])
        if "path" in given:
            return SetSpec(name, path=str(given["path"]))
        base = NAMED.get(name)
        if base is None and "dataset" not in given:
            raise RegraftError(f"{key}.{name}", f"is no known set ({known_names()}) and names no dataset",
                               f"use one of those names, or give {{name: {name}, dataset: org/name or a folder, "
                               "split: test, ...}")
        spec = replace(base or SetSpec(name), name=name,
                       **{field: given[field] for field in FIELDS - {"name", "path"} if field in given})
        if base is not None and "dataset" in given:
            spec = replace(spec, source=f"{base.source}; read from {spec.dataset}")
    else:
        value = str(entry)
        if value in NAMED:
            spec = NAMED[value]
        elif value == "builtin" or value.startswith("@") or "/" in value or value.endswith(".jsonl") or \
                Path(value).exists():
            return SetSpec(Path(value).stem if value not in ("builtin",) else "builtin", path=value)
        else:
            raise RegraftError(f"{key}={value}", f"no such set: the known names are {known_names()}",
                               "use one of them, a chat JSONL path, or {name: x, dataset: org/name, split: test}")
    if spec.format not in FORMATS:
        raise RegraftError(f"{key}.{spec.name}", f"format {spec.format} is not one of {', '.join(FORMATS)}",
                           "set format= to one of them")
    if spec.limit is not None and int(spec.limit) < 1:
        raise RegraftError(f"{key}.{spec.name}", f"limit {spec.limit} keeps no rows", "set limit= to at least 1")
    return spec


def folder_fingerprint(folder: Path) -> list:
    """Names, sizes and mtimes of a local dataset's files: a copy that changes is materialised again."""
    return sorted((str(path.relative_to(folder)), path.stat().st_size, path.stat().st_mtime_ns)
                  for path in folder.rglob("*") if path.is_file())


def local(spec: SetSpec) -> Path | None:
    path = Path(str(spec.dataset)).expanduser()
    return path if path.exists() or str(spec.dataset).startswith(("/", ".", "~")) else None


def key_of(spec: SetSpec, eval_set: bool) -> str:
    made_from = {**asdict(spec), "source": None, "eval_set": eval_set, "version": VERSION}
    folder = local(spec)
    if folder is not None and folder.exists():
        made_from["files"] = folder_fingerprint(folder) if folder.is_dir() else [folder.stat().st_size,
                                                                                 folder.stat().st_mtime_ns]
    return hashlib.sha256(json.dumps(made_from, sort_keys=True, default=str).encode()).hexdigest()[:16]


def target(spec: SetSpec, cache: Path, eval_set: bool) -> Path:
    """Where the set's chat JSONL is (or will be) in the cache."""
    return Path(cache) / "datasets" / f"{spec.name}-{key_of(spec, eval_set)}" / "chats.jsonl"


def fetch_command(spec: SetSpec) -> str:
    subset = f"'{spec.subset}', " if spec.subset else ""
    return (f"python -c \"import datasets; datasets.load_dataset('{spec.dataset}', {subset}split='{spec.split}')\" "
            "on a connected machine with the same HF_HOME")


def load_rows(spec: SetSpec, key: str) -> Iterable[dict]:
    """The split's rows, through `datasets`: a save_to_disk folder, a data file, a folder in the hub's layout or a
    hub id (from datasets' cache first; HF_DATASETS_OFFLINE=1 never asks the hub)."""
    import datasets

    folder = local(spec)
    where = f"{key}.{spec.name}"
    if folder is not None and not folder.exists():
        raise RegraftError(folder, f"{where}: the dataset folder does not exist",
                           f"point dataset= at a local copy (hf download {NAMED.get(spec.name, spec).dataset} "
                           "--repo-type dataset --local-dir DIR), or at a hub id")
    try:
        if folder is not None and folder.is_dir() and any((folder / name).exists()
                                                          for name in ("dataset_dict.json", "state.json")):
            loaded = datasets.load_from_disk(str(folder))  # a save_to_disk folder
            if isinstance(loaded, datasets.DatasetDict):
                if spec.split not in loaded:
                    raise ValueError(f"Unknown split \"{spec.split}\". Should be one of {list(loaded)}")
                loaded = loaded[spec.split]
            return loaded
        if folder is not None and folder.is_file():
            builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(folder.suffix)
            return datasets.load_dataset(builder, data_files=str(folder), split="train")
        return datasets.load_dataset(str(folder or spec.dataset), spec.subset, split=spec.split)
    except RegraftError:
        raise
    except Exception as exc:  # noqa: BLE001 (datasets' own errors: one line, with the fix)
        said = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        unreachable = isinstance(exc, ConnectionError) or any(
            word in said.lower() for word in ("offline", "reach", "connect", "localentrynotfound", "resolve"))
        if folder is None and (offline or unreachable):
            mode = "HF_DATASETS_OFFLINE=1" if offline else "the hub cannot be reached"
            raise RegraftError(where, f"{spec.dataset} (split {spec.split}) is not in the local datasets cache and "
                               f"{mode}", f"fetch it with `{fetch_command(spec)}`, or download it (hf download "
                               f"{spec.dataset} --repo-type dataset --local-dir DIR) and give {{name: {spec.name}, "
                               "dataset: DIR}") from None
        raise RegraftError(where, f"{spec.dataset} (subset {spec.subset}, split {spec.split}) does not load: "
                           f"{type(exc).__name__}: {said}", "check dataset=, subset= and split=") from None


def conversations(spec: SetSpec, rows: Iterable[dict], eval_set: bool, key: str) -> Iterable[list[dict]]:
    """Each row as regraft's messages, the first `limit` rows; an eval set keeps its user turns only."""
    convert = FORMATS[spec.format]
    for index, row in enumerate(rows):
        if spec.limit is not None and index >= int(spec.limit):
            return
        try:
            messages = convert(row, spec.column)
        except (KeyError, TypeError) as exc:
            raise RegraftError(f"{key}.{spec.name}", f"row {index} of {spec.dataset} has no {exc} in the layout "
                               f"format {spec.format} reads (its columns: {', '.join(row)})",
                               "set format= and column= to its layout") from None
        if eval_set:
            messages = [message for message in messages if message["role"] == "user"]
        if messages:
            yield messages


def materialise(spec: SetSpec, cache: Path, eval_set: bool, key: str = "data.eval_sets") -> Path:
    """The set as a chat JSONL in the cache, made once (in a temp folder, renamed into place, manifest inside)."""
    path = target(spec, cache, eval_set)
    if (path.parent / "manifest.json").is_file():
        return path
    written = 0
    temporary = path.parent.with_name(f".{path.parent.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    try:
        with (temporary / path.name).open("w") as out:
            for messages in conversations(spec, load_rows(spec, key), eval_set, key):
                out.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
                written += 1
        if not written:
            raise RegraftError(f"{key}.{spec.name}", f"{spec.dataset} (split {spec.split}) gave no conversations",
                               "check split=, format= and column=")
        manifest = {**asdict(spec), "eval_set": eval_set, "conversations": written, "version": VERSION}
        (temporary / "manifest.json").write_text(json.dumps(manifest, indent=2))
        try:
            temporary.rename(path.parent)
        except OSError:  # another run made it first: theirs is the same
            if not (path.parent / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return path
