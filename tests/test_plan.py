"""`regraft pipeline.plan=true`: every problem listed, the DAG with its cache states, and estimates held against
what the run then measured (tokens and feature bytes against the features manifest, parameters against the
exported drafter); no stage output, no MLflow run; on Slurm, batch scripts that `sbatch --test-only` accepts, and
each node's GPUs and ranks, with Slurm's commands here or not."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open


ROOT = Path(__file__).resolve().parents[1]
TINY = ["debug=tiny", "tracking.enabled=false"]


def regraft(outputs: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", *overrides],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=env)


def the_plan(outputs: Path) -> dict:
    plans = sorted((outputs / "runs").glob("*/plan.json"), key=lambda path: path.stat().st_mtime)
    return json.loads(plans[-1].read_text())


def stage_outputs(outputs: Path) -> list[Path]:
    return sorted((outputs / "cache").glob("*/*")) if (outputs / "cache").exists() else []


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Path:
    """The tiny pipeline planned on an empty outputs folder, then run: the folder of both."""
    outputs = tmp_path_factory.mktemp("plan")
    planned = regraft(outputs, *TINY, "pipeline.plan=true")
    assert planned.returncode == 0, planned.stdout[-3000:]
    assert not stage_outputs(outputs) and not (outputs / "mlflow.db").exists()
    (outputs / "first_plan.json").write_text(json.dumps(the_plan(outputs)))
    done = regraft(outputs, *TINY)
    assert done.returncode == 0, done.stdout[-3000:]
    return outputs


def test_a_plan_before_any_run_lists_every_node_to_run_and_writes_no_stage_output(ran):
    plan = json.loads((ran / "first_plan.json").read_text())
    assert plan["problems"] == []
    names = [row["node"] for row in plan["nodes"]]
    assert names[0] == "world" and {"finetune", "evaluate", "baseline_finetune"} <= set(names)
    assert not any(row["cached"] for row in plan["nodes"])
    features = next(row for row in plan["nodes"] if row["node"] == "features")
    assert features["feature_bytes"] is None and "is not there yet" in features["notes"][0]
    assert "features" in plan["totals"]["feature_bytes_unknown_for"]


def test_a_plan_after_the_run_holds_every_node_cached_and_its_estimates_match_the_outputs(ran):
    planned = regraft(ran, *TINY, "pipeline.plan=true")
    assert planned.returncode == 0, planned.stdout[-3000:]
    assert "plan: nothing has run" in planned.stdout
    plan = the_plan(ran)
    rows = {row["node"]: row for row in plan["nodes"]}
    assert all(row["cached"] for row in rows.values())
    assert plan["totals"]["gpu_hours"] == 0 and plan["totals"]["bytes"] == 0  # nothing left to run

    run = json.loads(next((ran / "runs").glob("*/summary.json")).read_text())["stages"]
    features = json.loads((Path(run["features"]["out"]) / "manifest.json").read_text())["metrics"]
    assert rows["features"]["tokens"] == features["tokens"]  # counted as the stage counts them
    assert rows["features"]["feature_bytes"] == pytest.approx(features["bytes"], rel=0.02)

    drafter = Path(run["finetune"]["out"]) / "drafter" / "model.safetensors"
    with safe_open(str(drafter), "pt") as tensors:
        weights = sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys()
                      if name not in ("d2t", "t2d"))
    assert f"; {weights:,} parameters (" in " ".join(rows["finetune"]["notes"])  # the drafter it exported
    assert rows["finetune"]["checkpoint_bytes"] >= weights * 4
    assert rows["finetune"]["gpu_hours"] > 0 and rows["probe"]["gpu_hours"] > 0 and rows["remap"]["gpu_hours"] == 0


def test_a_plan_of_unchanged_inputs_imports_no_torch_and_gives_the_same_figures(ran):
    """Its counts, the drafters' sizes and this machine's measured rate are kept: nothing to build or measure."""
    first = regraft(ran, *TINY, "pipeline.plan=true")
    assert first.returncode == 0, first.stdout[-3000:]
    kept = the_plan(ran)
    again = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipelines.regraft", f"paths.outputs={ran}",
                            *TINY, "pipeline.plan=true"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in again.stderr.splitlines() if line.startswith("import time:")}
    assert "omegaconf" in imported and "torch" not in imported
    assert the_plan(ran)["nodes"] == kept["nodes"] and the_plan(ran)["totals"] == kept["totals"]


def test_a_plan_lists_every_problem_and_exits_1(tmp_path):
    done = regraft(tmp_path, *TINY, "pipeline.plan=true", "finetune.lr=-1", "probe.backend=vllm",
                   "probe.vllm.python=/nowhere/python")
    assert done.returncode == 1
    problems = the_plan(tmp_path)["problems"]
    assert any(problem.startswith("finetune.lr=-1.0: must be > 0") for problem in problems), problems
    assert any("probe.vllm.python=/nowhere/python: no vLLM engine venv there" in p for p in problems), problems
    assert done.stdout.count("problem:") == len(problems) and "2 problem(s) above" in done.stdout.splitlines()[-1]
    assert not stage_outputs(tmp_path)


def test_a_device_the_plan_does_not_know_is_a_problem_not_a_crash(tmp_path):
    done = regraft(tmp_path, *TINY, "pipeline.plan=true", "plan.device=tpu")
    assert done.returncode == 1 and "Traceback" not in done.stdout and "crashed" not in done.stdout
    assert the_plan(tmp_path)["problems"] == ["plan.device=tpu: is not one of plan.devices (cpu, b200, gb200, b300, "
                                              "h200, h100, a100) (fix: set plan.device= to one of them, or add it: "
                                              "'+plan.devices.tpu={tflops: 2250, utilisation: 0.4}')"]


def test_a_plan_on_a_gpu_costs_the_same_flops_at_the_gpus_rate(ran):
    cpu = the_plan(ran)
    gpu = regraft(ran, *TINY, "pipeline.plan=true", "plan.device=h200")
    assert gpu.returncode == 0, gpu.stdout[-2000:]
    h200 = the_plan(ran)
    assert h200["rate"] == "h200: 989 TFLOP/s x utilisation 0.4"
    for on_cpu, on_gpu in zip(cpu["nodes"], h200["nodes"]):
        assert on_gpu["flops"] == on_cpu["flops"]
        if on_gpu["flops"]:
            assert on_gpu["gpu_hours"] == pytest.approx(on_gpu["flops"] / (989e12 * 0.4) / 3600)


def test_a_plan_on_a_gpu_checks_each_fine_tunes_rank_memory_against_it(ran):
    """Priced on a GPU, a fine-tune that would run has its rank's peak estimated (stages/common/drafter/memory.py) and
    held against one GPU's memory: the tiny drafter fits a B200; on a GPU of 1 MB the plan lists it as a problem."""
    again = ["finetune.micro_batch_size=2"]  # the fine-tunes would run again; what they read is there
    fits = regraft(ran, *TINY, *again, "pipeline.plan=true", "plan.device=b200")
    assert fits.returncode == 0, fits.stdout[-2000:]
    tunes = {row["node"]: row["rank_memory"] for row in the_plan(ran)["nodes"] if row["node"] in
             ("finetune", "baseline_finetune")}
    assert len(tunes) == 2 and all(memory["total"] == memory["model_states"] + memory["step"] +
                                   memory["target_side"] > 0 for memory in tunes.values())
    small = regraft(ran, *TINY, *again, "pipeline.plan=true", "plan.device=small",
                    "+plan.devices.small={tflops: 1, utilisation: 0.5, memory_gb: 0.001}")
    problems = [problem for problem in the_plan(ran)["problems"] if "a rank needs" in problem]
    assert small.returncode == 1 and sorted(problem.split(":")[0] for problem in problems) == \
        ["baseline_finetune", "finetune"], problems
    assert "over one small's 0.001 GB, 10% kept free (fix: lower finetune.micro_batch_size" in problems[0]


def test_an_online_server_on_the_same_gpus_takes_its_share_first():
    from omegaconf import OmegaConf

    from pipelines.modes.plan import gpu_bytes_for_training

    started_here = OmegaConf.create({"engine": {"enabled": True, "server_url": None,
                                                "vllm": {"gpu_memory_utilization": 0.75}}})
    assert gpu_bytes_for_training(started_here, 180) == (pytest.approx(45e9), ", less the online server's 0.75")
    elsewhere = OmegaConf.merge(started_here, {"engine": {"server_url": "http://node:8000"}})
    assert gpu_bytes_for_training(elsewhere, 180) == (180e9, "")


def test_a_jobs_shape_names_its_gpus_on_every_launcher_that_gives_them():
    from pipelines.modes.plan import job_shape

    assert job_shape("slurm", {"nodes": 2, "tasks_per_node": 8, "gpus_per_node": 8, "cpus_per_task": 12,
                               "timeout_min": 1440}) == "2x8 8g 12c 24h"
    assert job_shape("slurm", {"gpus_per_node": 0, "cpus_per_task": 2}) == "1x1 2c"
    assert [job_shape("local", {"gpus_per_node": 8}), job_shape("local", {}), job_shape("inline", {})] == \
        ["local 8g", "local", "inline"]


KIMI_ON_SLURM = ["experiment=kimi_k25", "launcher=slurm", "pipeline.plan=true"]
ENGINE_NODES, FINETUNES = ("features", "probe", "evaluate", "baseline_evaluate"), ("finetune", "baseline_finetune")


def without_slurm(folder: Path) -> dict[str, str]:
    """This environment with a PATH that holds no Slurm command (nor anything else)."""
    folder.mkdir(exist_ok=True)
    return {**os.environ, "PATH": str(folder)}


def kimi_plan(outputs: Path, *overrides: str, env: dict | None = None) -> tuple[str, dict]:
    """The Slurm plan of experiment=kimi_k25 (its paths are placeholders: those problems, and none of the launcher)."""
    done = regraft(outputs, *KIMI_ON_SLURM, *overrides, env=env)
    plan = the_plan(outputs)
    assert not [problem for problem in plan["problems"] if "launcher" in problem or "Slurm" in problem], plan
    assert done.returncode == 1 and "problem(s) above" in done.stdout  # /models/Kimi-K2.5 is not here
    return done.stdout, plan


def table_row(stdout: str, node: str) -> list[str]:
    return next([cell.strip() for cell in line.split("│")[1:-1]] for line in stdout.splitlines()
                if line.startswith(f"│ {node} "))


@pytest.mark.parametrize("slurm_here", [True, False], ids=["slurm-commands", "no-slurm-commands"])
def test_the_kimi_plan_on_slurm_gives_engine_stages_8_gpus_and_fine_tunes_8_ranks(tmp_path, slurm_here):
    stdout, plan = kimi_plan(tmp_path, env=None if slurm_here else without_slurm(tmp_path / "bin"))
    rows = {row["node"]: row for row in plan["nodes"]}
    assert plan["node_gpus"] == {"count": 8, "known": True, "from": "launcher.node_gpus"}
    assert "node GPUs: 8 (launcher.node_gpus)" in stdout
    for name in ENGINE_NODES:
        resources = rows[name]["resources"]
        assert (resources["gpus_per_node"], resources["tasks_per_node"], rows[name]["holds"]["gpus"]) == (8, 1, 8)
        assert "#SBATCH --gpus-per-node=8" in Path(plan["batch_scripts"][name]).read_text()
    for name in FINETUNES:
        resources = rows[name]["resources"]
        assert (resources["nodes"], resources["tasks_per_node"], resources["gpus_per_node"]) == (1, 8, 8)
        assert "#SBATCH --ntasks-per-node=8" in Path(plan["batch_scripts"][name]).read_text()
    assert table_row(stdout, "features")[2] == "1x1 8g 16c 24h" and table_row(stdout, "finetune")[2] == \
        "1x8 8g 12c 48h"
    assert rows["vocab_map"]["resources"]["gpus_per_node"] == 0
    assert rows["regenerate"]["holds"]["gpus"] == rows["diagnose"]["holds"]["gpus"] == 8  # its own server; vLLM
    noted = any(note.startswith("Slurm's commands are not on this machine") for note in plan["notes"])
    assert noted is not slurm_here
    # its data by name, listed and not fetched: the run fetches them first (docs/data.md)
    assert [(entry["name"], entry["dataset"]) for entry in plan["datasets"]] == [
        ("sharegpt", "Aeala/ShareGPT_Vicuna_unfiltered"), ("mtbench", "HuggingFaceH4/mt_bench_prompts"),
        ("humaneval", "openai/openai_humaneval"), ("gsm8k", "openai/gsm8k"), ("math500", "HuggingFaceH4/MATH-500")]
    assert "data: data.eval_sets gsm8k: openai/gsm8k main/test, question (fetched at the run's start)" in stdout
    assert not [problem for problem in plan["problems"] if "data." in problem], plan["problems"]


def test_the_kimi_plan_on_cpu_nodes_asks_for_no_gpu(tmp_path):
    stdout, plan = kimi_plan(tmp_path, "launcher.node_gpus=0", env=without_slurm(tmp_path / "bin"))
    rows = {row["node"]: row for row in plan["nodes"]}
    assert all(row["resources"]["gpus_per_node"] == 0 and row["holds"]["gpus"] == 0 for row in rows.values())
    assert [rows[name]["resources"]["tasks_per_node"] for name in FINETUNES] == [8, 8]
    assert table_row(stdout, "finetune")[2] == "1x8 12c 48h" and table_row(stdout, "probe")[2] == "1x1 16c 8h"


def test_sinfo_that_does_not_answer_is_said_and_taken_as_cpu_nodes(tmp_path):
    stdout, plan = kimi_plan(tmp_path, "launcher.node_gpus=null", env=without_slurm(tmp_path / "bin"))
    assert plan["node_gpus"]["count"] == 0 and not plan["node_gpus"]["known"]
    assert "node GPUs: 0 (not known: sinfo did not answer for the default partition here" in stdout
    assert {row["resources"]["gpus_per_node"] for row in plan["nodes"]} == {0}


@pytest.mark.slurm
def test_a_slurm_plan_writes_batch_scripts_sbatch_accepts(tmp_path, slurm_cluster):
    done = regraft(tmp_path, *TINY, "pipeline.plan=true", "launcher=slurm",
                   f"launcher.resources.slurm_partition={slurm_cluster.partition}",
                   "launcher.resources.cpus_per_task=1", "launcher.per_stage.finetune.cpus_per_task=1",
                   "launcher.per_stage.features.cpus_per_task=1", "launcher.per_stage.probe.cpus_per_task=1",
                   "launcher.per_stage.diagnose.cpus_per_task=1",
                   "launcher.resources.timeout_min=20", "launcher.per_stage.finetune.timeout_min=20")
    assert done.returncode == 0, done.stdout[-3000:]
    plan = the_plan(tmp_path)
    assert plan["node_gpus"] == {"count": 0, "known": True,  # the cluster's nodes have no gres
                                 "from": f"sinfo: partition {slurm_cluster.partition}, gres (null)"}
    scripts = plan["batch_scripts"]
    assert set(scripts) == {row["node"] for row in plan["nodes"] if not row["cached"]}
    for node, path in scripts.items():
        text = Path(path).read_text()
        assert f"#SBATCH --job-name=regraft-{node}" in text and "--dependency" not in text
        checked = subprocess.run(["sbatch", "--test-only", path], capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0 and "to start at" in checked.stderr, (node, checked.stderr)
    assert "#SBATCH --requeue" in Path(scripts["finetune"]).read_text()
    assert not stage_outputs(tmp_path)


def test_counts_are_kept_across_commands_until_an_input_changes(target_dir, chats, tmp_path, monkeypatch):
    """A plan of unchanged inputs counts nothing again: the token count is read from paths.outputs/estimates (no
    tokenizer loaded); a data file that changed (its size or mtime) is counted anew."""
    import os

    from pipelines.modes import estimates
    from stages.common.data import chat

    data = tmp_path / "chats.jsonl"
    data.write_bytes(chats.read_bytes())
    monkeypatch.setattr(estimates, "COUNTS_FOLDER", tmp_path / "estimates")
    first = estimates.chat_tokens(str(target_dir), str(data), 48, False, 10_000)
    estimates._chat_tokens.cache_clear()  # the next command: nothing in memory

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded")

    monkeypatch.setattr(chat, "load_tokenizer", no_tokenizer)
    assert estimates.chat_tokens(str(target_dir), str(data), 48, False, 10_000) == first
    estimates._chat_tokens.cache_clear()
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10 ** 9))
    with pytest.raises(AssertionError, match="the tokenizer was loaded"):
        estimates.chat_tokens(str(target_dir), str(data), 48, False, 10_000)
