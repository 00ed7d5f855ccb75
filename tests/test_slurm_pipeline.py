"""The pipeline on a real two-node Slurm cluster (tests/slurm_cluster.py): `regraft launcher=slurm`.

One Slurm job per stage chained with afterok, a sweep that submits its shared stages once, a 2-task (2-rank)
fine-tune equal to one rank with gradient accumulation 2, a fine-tune requeued twice (submitit's USR2 warning,
then `scontrol requeue`) that resumes from its checkpoints with every step once in MLflow, a stage job killed
with scancel that ends the pipeline with one line, and a SIGTERM to regraft that scancels its jobs. Skipped where
the cluster cannot come up (needs root).
    .venv/bin/python -m pytest -q tests/test_slurm_pipeline.py -m "not slow"   # 4-5 min on 2 busy cores
    .venv/bin/python -m pytest -q tests/test_slurm_pipeline.py                # + the requeue test, about 2 min

The world and the features (no Slurm edge depends on them) are built first in one plain process, into the same
`paths.outputs`, so the Slurm runs start at vocab_map and hit the cache for those two.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import pipelines.regraft  # noqa: F401  (registers every schema, for compose)
from pipelines.core.dag import Node
from pipelines.core.jobs import RANK_VARIABLES
from pipelines.launch.slurm import SlurmLauncher
from pipelines.launch.slurm_jobs import job_state
from stages.common.contract.stage import CONF_DIR
from stages.common.contract.errors import RegraftError
from tests.mlflow_checks import check_store

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
# a tiny world and tiny stages; every fine-tune here uses gradient accumulation 2 unless a test says otherwise
BASE = ["debug=tiny", "finetune.max_steps=6", "probe.num_prompts=3", "probe.max_new_tokens=16", "pipeline.probe=false",
        "pipeline.baseline=false", "pipeline.diagnose=false", "finetune.deepspeed.gradient_accumulation_steps=2"]
SWEEP_LRS = ("3e-3", "1e-2")


def slurm_overrides(cluster) -> list[str]:
    return ["launcher=slurm", f"launcher.resources.slurm_partition={cluster.partition}",
            "launcher.resources.cpus_per_task=1", "launcher.resources.timeout_min=20",
            "launcher.per_stage.finetune.cpus_per_task=1", "launcher.per_stage.features.cpus_per_task=1",
            "launcher.per_stage.probe.cpus_per_task=1", "launcher.per_stage.finetune.timeout_min=20",
            "launcher.poll_s=1"]  # the nodes' GPUs: none, as sinfo says


def job_env() -> dict[str, str]:
    """This process's environment (SLURM_CONF included), without rank variables an in-process test left."""
    return {key: value for key, value in os.environ.items() if key not in RANK_VARIABLES}


def regraft_argv(outputs: Path, cluster, name: str, *overrides: str, multirun: bool = False) -> list[str]:
    where = f"hydra.sweep.dir={outputs}/sweeps/{name}" if multirun else f"hydra.run.dir={outputs}/runs/{name}"
    return [sys.executable, "-m", "pipelines.regraft", *(["-m"] if multirun else []), f"paths.outputs={outputs}",
            where, *BASE, *slurm_overrides(cluster), *overrides]


def regraft(outputs: Path, cluster, name: str, *overrides: str, multirun: bool = False) -> None:
    done = subprocess.run(regraft_argv(outputs, cluster, name, *overrides, multirun=multirun), cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def submitted(run_dir: Path) -> dict[str, dict]:
    """The launcher's record of its submissions, by node."""
    lines = (run_dir / "jobs" / "submitted.jsonl").read_text().splitlines()
    return {record["node"]: record for record in map(json.loads, lines)}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())["stages"]


def job_folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "jobs").iterdir() if p.is_dir())


def wait_until(what: str, ready, timeout_s: float = 300.0, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not (value := ready()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)
    return value


PREBUILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from hydra import compose, initialize_config_dir
    from rich.console import Console
    import pipelines.regraft  # registers every schema
    from pipelines.core.dag import build_nodes
    from pipelines.core.runner import run_dag
    from pipelines.launch.inline import InlineLauncher
    from stages.common.contract.stage import CONF_DIR
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=sys.argv[1:])
    nodes = [node for node in build_nodes(cfg) if node.name in ("world", "source_map", "source_drafter", "features")]
    run_dag(nodes, Path(cfg.paths.cache), InlineLauncher(cfg.launcher, Path(cfg.paths.outputs) / "prebuild"), None,
            Console(quiet=True))
""")


@pytest.fixture(scope="module")
def sweep(slurm_cluster, tmp_path_factory):
    """world, the source drafter and features in one plain process, then `regraft -m finetune.lr=A,B` on Slurm (member
    runs 0 and 1, one DAG: its jobs recorded in the sweep's own jobs folder)."""
    outputs = tmp_path_factory.mktemp("slurm_pipeline")
    done = subprocess.run([sys.executable, "-c", PREBUILD, f"paths.outputs={outputs}", *BASE], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    regraft(outputs, slurm_cluster, "lr", f"finetune.lr={','.join(SWEEP_LRS)}", multirun=True)
    return outputs, [outputs / "sweeps" / "lr" / str(k) for k in range(len(SWEEP_LRS))]


def test_stages_run_as_slurm_jobs_chained_by_afterok(sweep):
    outputs, (first, second) = sweep
    jobs = submitted(outputs / "sweeps" / "lr")
    upstream = {"vocab_map": [], "compare": ["vocab_map"], "remap": ["vocab_map"],
                "finetune": ["vocab_map", "remap"], "evaluate": ["finetune"],  # world ... features: cache hits
                "finetune#1": ["vocab_map", "remap"], "evaluate#1": ["finetune#1"]}  # member 1's own
    assert set(jobs) == set(upstream)
    for node, ups in upstream.items():
        want = sorted(jobs[up]["job_id"] for up in ups)
        assert sorted(jobs[node]["after"]) == want, node
        # what Slurm holds (scontrol show job, read right after sbatch): "afterok:12(unfulfilled),afterok:14(...)"
        assert sorted(re.findall(r"afterok:(\d+)", jobs[node]["dependency"])) == want, jobs[node]["dependency"]
    for run, own in ((first, {"vocab_map": "vocab_map", "finetune": "finetune", "evaluate": "evaluate"}),
                     (second, {"finetune": "finetune#1", "evaluate": "evaluate#1"})):
        stages = summary(run)
        for node, union_node in own.items():
            assert stages[node]["job_id"] == jobs[union_node]["job_id"] and not stages[node]["hit"]
        assert all(stages[node]["hit"] for node in ("world", "source_map", "source_drafter", "features"))
        assert stages["evaluate"]["metrics"]["accept_len"] >= 1


def test_sweep_submits_shared_stages_once(sweep):
    outputs, (first, second) = sweep
    sweep_dir = outputs / "sweeps" / "lr"
    assert len(job_folders(sweep_dir)) == len(submitted(sweep_dir)) == 7  # one submitit folder per Slurm job
    stages = summary(second)
    assert all(stages[node]["hit"] for node in ("world", "vocab_map", "compare", "remap", "features"))
    assert stages["finetune"]["out"] != summary(first)["finetune"]["out"]


def test_one_dag_on_slurm_equals_the_sweep_member_by_member(sweep, slurm_cluster, tmp_path):
    """The fixture's sweep (one DAG) against the same sweep with Hydra's basic launcher (member after member), in a
    fresh outputs folder that starts from the same prebuilt world, source drafter and features."""
    from mlflow.tracking import MlflowClient

    outputs, runs = sweep
    for node in ("world", "source_map", "source_drafter", "features"):
        out = Path(summary(runs[0])[node]["out"])
        shutil.copytree(out, tmp_path / "cache" / out.parent.name / out.name)
    regraft(tmp_path, slurm_cluster, "lr", f"finetune.lr={','.join(SWEEP_LRS)}", "hydra/launcher=basic",
            multirun=True)

    def parents(folder: Path) -> dict[str, dict]:
        client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
        experiment = client.get_experiment_by_name("regraft")
        return {run.data.tags["member"]: run.data.metrics for run in client.search_runs([experiment.experiment_id])
                if "mlflow.parentRunId" not in run.data.tags and run.data.tags.get("sweep") == "lr"}

    untimed = lambda numbers: {k: v for k, v in numbers.items() if "seconds" not in k and "tok_s" not in k}
    for k, ours in enumerate(runs):
        theirs = json.loads((tmp_path / "sweeps" / "lr" / str(k) / "summary.json").read_text())
        mine = json.loads((ours / "summary.json").read_text())
        assert untimed(mine["numbers"]) == pytest.approx(untimed(theirs["numbers"]), rel=1e-6)
        assert {n: s["hit"] for n, s in mine["stages"].items()} == {n: s["hit"] for n, s in theirs["stages"].items()}
    ours, theirs = parents(outputs), parents(tmp_path)
    assert ours.keys() == theirs.keys() == {"0", "1"}
    for member in ours:
        assert untimed(ours[member]) == pytest.approx(untimed(theirs[member]), rel=1e-6)


def test_a_sweep_has_all_its_finetunes_queued_at_once(sweep, slurm_cluster):
    """Submitted up front with afterok: the four fine-tunes of a 4-member sweep are in Slurm's queue together."""
    outputs, _ = sweep
    lrs = ("1e-3", "4e-3", "6e-3", "7e-3")  # none another test here uses
    argv = regraft_argv(outputs, slurm_cluster, "four", f"finetune.lr={','.join(lrs)}", multirun=True)
    process = subprocess.Popen(argv, cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        def queued() -> list[str]:
            names = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout.split()
            found = [name for name in names if name.startswith("regraft-finetune")]
            return found if len(found) == 4 else []

        assert sorted(wait_until("four fine-tunes queued at once", queued, timeout_s=300)) == \
            ["regraft-finetune", "regraft-finetune#1", "regraft-finetune#2", "regraft-finetune#3"]
        output, _ = process.communicate(timeout=900)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    runs = [outputs / "sweeps" / "four" / str(k) for k in range(4)]
    losses = [summary(run)["finetune"]["metrics"]["val_loss"] for run in runs]
    assert len(set(losses)) == 4  # four fine-tunes, each its own lr
    # every child run of every sweep so far holds its own output's figures; none is left RUNNING or pending
    assert check_store(f"sqlite:///{outputs}/mlflow.db") >= 4 * 3


def node_list(job_id: str) -> str:
    """The nodes Slurm gave a job (kept MinJobAge seconds after it ends)."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return re.search(r" NodeList=(\S+)", shown)[1]


def test_rank_layouts_agree_one_rank_two_tasks_two_nodes(sweep, slurm_cluster):
    """One global batch three ways: 1 rank x accumulation 2 (the sweep's member), 1 node x 2 tasks, 2 nodes x 1
    task (rendezvous on the allocation's first node); each a cache key of its own."""
    outputs, (first, _) = sweep
    one = summary(first)["finetune"]
    for name, nodes, nproc in (("two_tasks", 1, 2), ("two_nodes", 2, 1)):
        regraft(outputs, slurm_cluster, name, f"finetune.lr={SWEEP_LRS[0]}", f"finetune.nproc={nproc}",
                f"finetune.nodes={nodes}", "finetune.deepspeed.gradient_accumulation_steps=1",
                "pipeline.evaluate=false")
        run = outputs / "runs" / name
        jobs = submitted(run)
        assert set(jobs) == {"finetune"} and jobs["finetune"]["tasks"] == 2
        assert node_list(jobs["finetune"]["job_id"]) == ("n[1-2]" if nodes == 2 else node_list(
            jobs["finetune"]["job_id"]))
        folder = run / "jobs" / jobs["finetune"]["job_id"]
        assert sorted(p.name for p in folder.glob("*_result.pkl")) == [f"{folder.name}_{k}_result.pkl" for k in (0, 1)]
        two = summary(run)["finetune"]
        assert two["key"] != one["key"]  # the rank layout is in the cache key
        assert two["metrics"]["val_loss"] == pytest.approx(one["metrics"]["val_loss"], rel=1e-4), name
        steps = [json.loads(line) for line in (Path(two["out"]) / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps if m["split"] == "train"] == [1, 2, 3, 4, 5, 6]


def sbatch_options(run: Path, job_id: str) -> dict[str, str]:
    """The `#SBATCH --option=value` lines a job was submitted with (submitit's script in its job folder)."""
    script = (run / "jobs" / job_id / f"{job_id}_submission.sh").read_text()
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)$", script, re.M))


def test_a_race_submits_every_rung_with_the_fine_tunes_tasks(sweep, slurm_cluster):
    """launcher.per_stage is by stage: every rung of a race (finetune nodes named by their candidates) gets
    finetune's 2 tasks and its time, the finalists' evaluations probe's time; phase 1 (`evaluate`) is the winner's
    evaluation again, a cache hit that submits nothing."""
    outputs, _ = sweep
    regraft(outputs, slurm_cluster, "race", "pipeline.race=true", "race.inits=[remap,scratch]", "race.lrs=[3e-3]",
            "race.budget_steps=6", "race.rungs=2", "finetune.nproc=2",
            "finetune.deepspeed.gradient_accumulation_steps=1", "launcher.per_stage.probe.timeout_min=17")
    run = outputs / "runs" / "race"
    jobs = submitted(run)
    rungs = sorted(name for name in jobs if name.startswith("race_") and not name.endswith("_evaluate"))
    assert rungs == [f"race_{init}_lr0.003_step{step}" for init in ("remap", "scratch") for step in (3, 6)], jobs
    for name in rungs:
        options = sbatch_options(run, jobs[name]["job_id"])
        assert (jobs[name]["tasks"], options["ntasks-per-node"], options["nodes"], options["time"]) == \
            (2, "2", "1", "20"), (name, options)
    evaluations = sorted(name for name in jobs if name.endswith("evaluate"))
    assert evaluations == ["race_remap_lr0.003_evaluate", "race_scratch_lr0.003_evaluate"], jobs
    assert [sbatch_options(run, jobs[name]["job_id"])["time"] for name in evaluations] == ["17", "17"]
    assert all(sbatch_options(run, jobs[name]["job_id"])["ntasks-per-node"] == "1" for name in evaluations)
    phase1 = summary(run)["evaluate"]
    assert phase1["hit"] and phase1["metrics"]["accept_len"] >= 1


def test_feature_parts_across_nodes_rerun_only_the_cancelled_one(sweep, slurm_cluster):
    """features.parts=4 on 2 nodes: four jobs, each a cached output; one cancelled, the rerun computes only it, and
    the joined features equal the ones computed in one job (the sweep's, cached by the fixture)."""
    from stages.common.contract.artifacts import read_manifest
    from stages.common.data.feature_shards import load_features

    outputs, (first, _) = sweep
    parts = ["features.parts=4", "pipeline.evaluate=false", f"finetune.lr={SWEEP_LRS[0]}"]
    late = "+launcher.per_node.features_2={additional_parameters: {begin: now+600}}"  # not in any cache key
    process, log = run_in_background(outputs, slurm_cluster, "parts", *parts, late)
    try:
        run = outputs / "runs" / "parts"
        names = {f"features_{k}" for k in range(4)}
        jobs = wait_until("the four parts submitted", lambda: process.poll() is None and (
            run / "jobs" / "submitted.jsonl").exists() and names <= set(submitted(run)) and submitted(run))
        late_job = jobs["features_2"]["job_id"]
        others = [jobs[f"features_{k}"]["job_id"] for k in (0, 1, 3)]
        wait_until("the other parts done", lambda: all(job_state(job) == "COMPLETED" for job in others))
        nodes = {node_list(job) for job in others}
        subprocess.run(["scancel", late_job], check=True, capture_output=True)
        assert process.wait(timeout=120) == 1, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert nodes == {"n1", "n2"}  # the parts ran on both nodes
    assert f"Slurm job {late_job} ended CANCELLED" in log.read_text()
    regraft(outputs, slurm_cluster, "parts_again", *parts)
    again = submitted(outputs / "runs" / "parts_again")
    assert {name for name in again if name.startswith("features")} == {"features_2", "features"}  # + the join
    stages = summary(outputs / "runs" / "parts_again")
    assert all(stages[f"features_{k}"]["hit"] for k in (0, 1, 3))
    whole = summary(first)["features"]["out"]
    manifest = read_manifest(whole)
    a = load_features(whole, manifest["aux_layer_ids"], manifest["max_length"])
    b = load_features(stages["features"]["out"], manifest["aux_layer_ids"], manifest["max_length"])
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert stages["finetune"]["metrics"]["val_loss"] == pytest.approx(
        summary(first)["finetune"]["metrics"]["val_loss"], rel=1e-6)  # the fine-tune reads the same rows


def run_in_background(outputs: Path, cluster, name: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    log = outputs / f"{name}.log"
    process = subprocess.Popen(regraft_argv(outputs, cluster, name, *overrides), cwd=ROOT, env=job_env(),
                               stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    return process, log


def finetune_job(run: Path) -> str:
    return wait_until("the finetune job's submission", lambda: (run / "jobs" / "submitted.jsonl").exists()
                      and submitted(run).get("finetune", {}).get("job_id"))


def requeue_now(job_id: str) -> None:
    """A requeued job waits BeginTime (Slurm's credential lifetime, 120 s); once its old processes are gone and
    their credential is at least a second old, it may start at once."""
    wait_until(f"job {job_id} pending again", lambda: job_state(job_id) == "PENDING", timeout_s=60)
    time.sleep(5)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, capture_output=True)


def train_steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [m["step"] for m in lines if m["split"] == "train"]


EPOCHS = 4  # per node: 36 steps on one rank, 32 on two


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_requeued_finetune_resumes_without_repeating_steps(sweep, slurm_cluster, nodes):
    from mlflow.tracking import MlflowClient

    outputs, _ = sweep
    before = set((outputs / "cache" / "finetune").glob("*.checkpoints"))
    process, log = run_in_background(outputs, slurm_cluster, f"requeue{nodes}", "finetune.lr=5e-3",
                                     "finetune.max_steps=null", f"finetune.nodes={nodes}",
                                     # two ranks take half the steps an epoch; enough steps are left after the
                                     # first resume that the second requeue always lands mid-training
                                     f"finetune.epochs={EPOCHS * nodes}",
                                     "finetune.deepspeed.gradient_accumulation_steps=1", "finetune.checkpoint_every=1",
                                     "pipeline.evaluate=false")
    try:
        run = outputs / "runs" / f"requeue{nodes}"
        job_id = finetune_job(run)
        work = wait_until("the finetune's work folder", lambda: next(
            iter(set((outputs / "cache" / "finetune").glob("*.checkpoints")) - before), None))
        job_log = run / "jobs" / job_id / f"{job_id}_0_log.err"
        # 1. submitit's time-limit/preemption warning: checkpoint() resubmits the call, submitit requeues the job
        wait_until("a first training step", lambda: train_steps(work / "metrics.jsonl"))
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, capture_output=True)
        requeue_now(job_id)
        resumed = wait_until("the first resume", lambda: re.findall(r"resumed at step (\d+)", job_log.read_text()))
        first = int(resumed[0])
        # 2. Slurm's own requeue (as preemption with PreemptMode=REQUEUE): SIGTERM, a checkpoint, no result file
        wait_until("two more steps", lambda: max(train_steps(work / "metrics.jsonl"), default=0) >= first + 2)
        subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True)
        requeue_now(job_id)
        assert process.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    resumes = [int(step) for step in re.findall(r"resumed at step (\d+)", job_log.read_text())]
    assert len(resumes) == 2 and 1 <= resumes[0] < resumes[1], resumes
    assert job_log.read_text().count("DUE TO JOB REQUEUE") >= 2
    stages = summary(run)
    per_epoch = 36 // (4 * nodes)  # 36 training chats in global batches of 4 x ranks
    total = per_epoch * EPOCHS * nodes
    assert train_steps(Path(stages["finetune"]["out"]) / "metrics.jsonl") == list(range(1, total + 1))
    client = MlflowClient(f"sqlite:///{outputs}/mlflow.db")
    experiment = client.get_experiment_by_name("regraft")
    [child] = client.search_runs([experiment.experiment_id], f"tags.job_id = '{job_id}'")
    for key, steps in (("train/loss", list(range(1, total + 1))),
                       ("val/loss", list(range(per_epoch, total + 1, per_epoch)))):
        history = client.get_metric_history(child.info.run_id, key)
        assert sorted(m.step for m in history) == steps, key  # each step once: none repeated, none missing


def stopped_while_finetuning(outputs: Path, cluster, name: str, lr: str, stop) -> tuple[int, str, str, str]:
    """Run regraft until its finetune job runs and evaluate is queued, then `stop(process, finetune job id)`.
    Returns regraft's exit status, its output, and the finetune and evaluate job ids."""
    process, log = run_in_background(outputs, cluster, name, f"finetune.lr={lr}")
    try:
        run = outputs / "runs" / name
        job_id = finetune_job(run)
        wait_until("the finetune job running", lambda: job_state(job_id) == "RUNNING")
        evaluate = wait_until("evaluate's submission", lambda: submitted(run).get("evaluate", {}).get("job_id"))
        stop(process, job_id)
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    return code, log.read_text(), job_id, evaluate


def test_cancelled_stage_job_ends_the_pipeline_with_one_line(sweep, slurm_cluster):
    code, output, job_id, evaluate = stopped_while_finetuning(
        sweep[0], slurm_cluster, "cancel", "2e-3",
        lambda process, job: subprocess.run(["scancel", job], check=True, capture_output=True))
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and f"Slurm job {job_id} ended CANCELLED" in errors[0], output[-3000:]
    assert wait_until("evaluate cancelled", lambda: job_state(evaluate) == "CANCELLED", timeout_s=30)


def test_sigterm_to_regraft_cancels_its_slurm_jobs(sweep, slurm_cluster):
    # as `kill`, or a scheduler ending the job regraft itself runs in
    code, output, job_id, evaluate = stopped_while_finetuning(
        sweep[0], slurm_cluster, "sigterm", "1.5e-3", lambda process, job: process.terminate())
    assert code == 130 and "interrupted: the running stages were cancelled" in output, output[-3000:]
    for job in (job_id, evaluate):
        assert wait_until(f"job {job} cancelled", lambda: job_state(job) == "CANCELLED", timeout_s=30)


def test_ranks_must_match_the_stages_nproc():
    """The rank count sets the global batch, so it comes from the stage config (its cache key), not the launcher."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        root = compose("config", overrides=["launcher=slurm", "finetune.nproc=4", "finetune.nodes=2",
                                            "launcher.node_gpus=4"])
    resources = SlurmLauncher(root.launcher, Path("unused")).resources(Node("finetune", "finetune", root.finetune, "1"))
    assert resources["tasks_per_node"] == resources["gpus_per_node"] == 4 and resources["nodes"] == 2
    cfg = OmegaConf.create({"name": "slurm", "poll_s": 1.0, "resources": {"tasks_per_node": 1},
                            "per_stage": {"finetune": {"tasks_per_node": 2}}})
    launcher = SlurmLauncher(cfg, Path("unused"))
    node = Node("finetune", "finetune", OmegaConf.create({"nproc": 1}), "1")
    says = r"finetune would run as 1 node\(s\) x 2 Slurm tasks .* \(fix: set finetune.nodes=1 finetune.nproc=2\)"
    with pytest.raises(RegraftError, match=says):
        launcher.submit(node, OmegaConf.create({"nproc": 1, "out": "x"}), [])
    vocab = Node("vocab_map", "vocab_map", OmegaConf.create({}), "prep")
    launcher.cfg.per_stage["vocab_map"] = {"tasks_per_node": 2}
    with pytest.raises(RegraftError, match=r"fix: set launcher.per_stage.vocab_map.tasks_per_node=1"):
        launcher.submit(vocab, OmegaConf.create({"out": "x"}), [])
