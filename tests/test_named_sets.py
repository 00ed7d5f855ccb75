"""Eval sets and training data by name (stages/common/data/named.py, pipelines/core/data_sets.py): each named set's
conversion on a tiny local copy in its source's real column layout, loaded through the same `datasets` code as a hub
id; an unknown name and an offline miss refused before any work with one line; `regraft debug=tiny` measuring
accept_len per named set."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from stages.common.contract.errors import RegraftError  # noqa: E402
from stages.common.data.named import NAMED, describe, materialise  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def readme(configs: list[tuple[str, str, str]]) -> str:
    """A hub dataset card's `configs:` block: (config, split, files) as the hub repos write them."""
    lines = ["---", "configs:"]
    for config in dict.fromkeys(name for name, _, _ in configs):
        lines += [f"- config_name: {config}", "  data_files:"]
        lines += [f"  - split: {split}\n    path: {files}" for name, split, files in configs if name == config]
    return "\n".join(lines + ["---", ""])


def hub_folder(root: Path, rows: list[dict], files: str, configs: list[tuple[str, str, str]] | None = None) -> Path:
    """A folder in a hub repo's layout: the rows in one file at `files` (parquet or JSON lines), a README's configs."""
    path = root / files
    path.parent.mkdir(parents=True, exist_ok=True)
    table = datasets.Dataset.from_list(rows)
    if files.endswith(".parquet"):
        table.to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if configs:
        (root / "README.md").write_text(readme(configs))
    return root


@pytest.fixture(scope="module")
def copies(tmp_path_factory) -> dict[str, Path]:
    """One local copy per named set, with a handful of rows in the source's own columns."""
    root = tmp_path_factory.mktemp("named_sets")
    mtbench = datasets.DatasetDict({"train": datasets.Dataset.from_list([  # HuggingFaceH4/mt_bench_prompts
        {"prompt": [f"Write a poem about {topic}.", "Now make it rhyme."], "prompt_id": 81 + i,
         "category": "writing", "reference": []} for i, topic in enumerate(["rivers", "tea", "maps", "owls"])])})
    mtbench.save_to_disk(str(root / "mtbench"))  # a save_to_disk folder
    gsm8k = [{"question": f"Tom has {n} apples and eats one. How many are left?", "answer": f"{n}-1={n - 1}\n#### {n - 1}"}
             for n in range(2, 8)]
    humaneval = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
                  "canonical_solution": f"    return x + {i}\n", "test": "def check(f): pass", "entry_point": f"f{i}"}
                 for i in range(5)]
    math500 = [{"problem": f"What is ${i}+{i}$?", "solution": f"$\\boxed{{{2 * i}}}$", "answer": str(2 * i),
                "subject": "Algebra", "level": 1, "unique_id": f"test/algebra/{i}.json"} for i in range(5)]
    sharegpt = [{"id": f"s{i}", "conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": f"hello {i}"},
        {"from": "gpt", "value": f"hi {i}"}, {"from": "human", "value": "and then?"},
        {"from": "gpt", "value": "then nothing"}]} for i in range(4)]
    ultrachat = [{"prompt": f"tell me about {i}", "prompt_id": f"u{i}", "messages": [
        {"role": "user", "content": f"tell me about {i}"}, {"role": "assistant", "content": f"{i} is a number"}]}
        for i in range(4)]
    return {
        "mtbench": root / "mtbench",
        "gsm8k": hub_folder(root / "gsm8k", gsm8k, "main/test-00000-of-00001.parquet",
                            [("main", "test", "main/test-*"), ("main", "train", "main/test-*")]),
        "humaneval": hub_folder(root / "humaneval", humaneval, "openai_humaneval/test-00000-of-00001.parquet",
                                [("openai_humaneval", "test", "openai_humaneval/test-*")]),
        "math500": hub_folder(root / "math500", math500, "test.jsonl"),
        "sharegpt": hub_folder(root / "sharegpt", sharegpt, "ShareGPT_V3_unfiltered_cleaned_split.json"),
        "ultrachat": hub_folder(root / "ultrachat", ultrachat, "data/train_sft-00000-of-00001.parquet",
                                [("default", "train_sft", "data/train_sft-*")]),
    }


def chats(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


EXPECTED = {  # conversations, user turns of the first, and whether it keeps answers (training data)
    "mtbench": (4, 2, False), "gsm8k": (6, 1, False), "humaneval": (5, 1, False), "math500": (5, 1, False),
    "sharegpt": (4, 2, True), "ultrachat": (4, 1, True)}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_named_set_becomes_chats_from_its_own_layout(name, copies, tmp_path):
    spec = replace(NAMED[name], dataset=str(copies[name]))
    eval_set = not EXPECTED[name][2]
    path = materialise(spec, tmp_path / "cache", eval_set=eval_set)
    conversations = chats(path)
    count, users, answers = EXPECTED[name]
    assert len(conversations) == count
    assert sum(message["role"] == "user" for message in conversations[0]) == users
    roles = {message["role"] for messages in conversations for message in messages}
    assert roles == ({"user", "assistant"} if answers else {"user"})  # ShareGPT's system turn dropped, as SpecForge
    if name == "mtbench":
        assert [m["content"] for m in conversations[0]] == ["Write a poem about rivers.", "Now make it rhyme."]
    if name == "sharegpt":
        assert conversations[0][:2] == [{"role": "user", "content": "hello 0"}, {"role": "assistant", "content": "hi 0"}]
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["conversations"] == count and manifest["dataset"] == str(copies[name])


def test_the_limit_keeps_the_first_rows_and_a_set_is_made_once_the_same(copies, tmp_path):
    spec = describe({"name": "gsm8k", "dataset": str(copies["gsm8k"]), "limit": 3}, "data.eval_sets")
    first = materialise(spec, tmp_path / "a", eval_set=True)
    again = materialise(spec, tmp_path / "b", eval_set=True)
    assert [m[0]["content"] for m in chats(first)] == [f"Tom has {n} apples and eats one. How many are left?"
                                                       for n in (2, 3, 4)]
    assert first.read_bytes() == again.read_bytes() and first.parent.name == again.parent.name  # keyed by content
    stamp = first.stat().st_mtime_ns
    assert materialise(spec, tmp_path / "a", eval_set=True) == first and first.stat().st_mtime_ns == stamp
    assert materialise(replace(spec, limit=None), tmp_path / "a", eval_set=True) != first


def test_a_hub_id_or_folder_with_its_own_fields_works_too(copies, tmp_path):
    spec = describe({"name": "algebra", "dataset": str(copies["math500"]), "split": "test", "column": "solution"},
                    "data.eval_sets")
    assert chats(materialise(spec, tmp_path, eval_set=True))[0] == [{"role": "user", "content": "$\\boxed{0}$"}]
    assert describe("@world/prompts_b_code.jsonl", "data.train").path == "@world/prompts_b_code.jsonl"
    assert describe({"name": "chat", "path": "/p.jsonl"}, "data.eval_sets").path == "/p.jsonl"


def test_an_unknown_name_or_a_wrong_column_is_one_line():
    with pytest.raises(RegraftError, match="no such set: the known names are mtbench, humaneval, gsm8k, math500"):
        describe("mtbnech", "data.eval_sets")
    with pytest.raises(RegraftError, match="is no known set .* and names no dataset"):
        describe({"name": "mine", "split": "test"}, "data.eval_sets")


def regraft(outputs: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", "debug=tiny",
                           *overrides], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


def test_an_unknown_name_and_an_offline_miss_are_refused_before_any_work(tmp_path):
    done = regraft(tmp_path / "out", "data.eval_sets=[mtbench,gsm8kk]")
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1].startswith("error: data.eval_sets=gsm8kk: no such set: the known names")
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = regraft(tmp_path / "out", "data.eval_sets=[mtbench,gsm8k]", env=offline)
    line = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1 and line.startswith(
        "error: data.eval_sets.mtbench: HuggingFaceH4/mt_bench_prompts (split train) is not in the local datasets "
        "cache and HF_DATASETS_OFFLINE=1 (fix: fetch it with `python -c \"import datasets; "
        "datasets.load_dataset('HuggingFaceH4/mt_bench_prompts', split='train')\"")
    assert not list((tmp_path / "out").glob("cache/*/*/manifest.json"))  # no stage ran


@pytest.mark.slow
def test_regraft_measures_accept_len_per_named_set(copies, tmp_path):
    outputs = tmp_path / "out"
    sets = f"data.eval_sets=[{{name: mtbench, dataset: '{copies['mtbench']}'}}, {{name: gsm8k, dataset: '{copies['gsm8k']}'}}]"
    plan = regraft(outputs, sets, "pipeline.plan=true")
    assert f"data: data.eval_sets mtbench: {copies['mtbench']} train, prompt/turns (fetched at the run's start)" \
        in plan.stdout, plan.stdout[-3000:]
    done = regraft(outputs, sets)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((sorted((outputs / "runs").iterdir())[-1] / "summary.json").read_text())
    numbers = summary["numbers"]
    assert {"phase0/accept_len/mtbench", "phase0/accept_len/gsm8k", "phase1/accept_len/mtbench",
            "phase1/accept_len/gsm8k"} <= set(numbers)
    assert len(list((outputs / "cache" / "datasets").glob("*/manifest.json"))) == 2
