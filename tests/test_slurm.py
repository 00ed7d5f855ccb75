"""submitit jobs on a real two-node Slurm cluster (tests/slurm_cluster.py), watched by pipelines/launch/slurm_jobs.py.

Needs root and Debian's Slurm packages (installed on first use); skipped when the cluster cannot come up.
    .venv/bin/python -m pytest -q tests/test_slurm.py -m "not slow"   # 25-50 s on 2 cores
    .venv/bin/python -m pytest -q tests/test_slurm.py                # + a real time-limit kill: 60-100 s more

The submitted functions live at module level here: submitit pickles them by reference, so the job's Python
imports this module (the executor's setup puts tests/ and the repo on PYTHONPATH, as pytest's sys.path does).
"""
from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest
import submitit

from pipelines.launch.slurm_jobs import dependency_of, job_state, wait_for
from stages.common.contract.errors import RegraftError

pytestmark = pytest.mark.slurm

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _cluster(slurm_cluster):  # every test here needs the cluster; all skip when it is down
    return slurm_cluster


# ---- functions the jobs run ----------------------------------------------------------------------------------

def add(a: int, b: int) -> int:
    return a + b


def stamp_after(sleep_s: float) -> float:
    time.sleep(sleep_s)
    return time.time()


def stamp() -> float:
    return time.time()


def boom(n: int) -> None:
    raise ValueError(f"boom {n}")


def sleep_through_warning(sleep_s: float) -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # submitit's time-limit warning; Slurm's kill then ends it
    time.sleep(sleep_s)


def rank() -> int:
    return submitit.JobEnvironment().global_rank


# ---- helpers ---------------------------------------------------------------------------------------------------

def executor(folder: Path, cluster, **params) -> submitit.AutoExecutor:
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(timeout_min=5, cpus_per_task=1, slurm_partition=cluster.partition,
                         slurm_setup=[f"export PYTHONPATH={TESTS}:{TESTS.parent}${{PYTHONPATH:+:$PYTHONPATH}}"])
    ex.update_parameters(**params)
    return ex


def wait_until(job, state: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while job_state(job) != state:
        assert time.monotonic() < deadline, f"job {job.job_id} never {state} (now {job_state(job)})"
        time.sleep(0.2)


# ---- tests -----------------------------------------------------------------------------------------------------

def test_result_and_completed(tmp_path, slurm_cluster):
    job = executor(tmp_path, slurm_cluster).submit(add, 2, 3)
    states = []
    assert wait_for([job], poll_s=0.2, timeout_s=60, on_state=lambda j, s: states.append(s)) == [5]
    assert job_state(job) == "COMPLETED"
    assert states[-1] == "COMPLETED"


def test_afterok_chain_runs_in_order(tmp_path, slurm_cluster):
    ex = executor(tmp_path, slurm_cluster)
    first = ex.submit(stamp_after, 2.0)
    ex.update_parameters(slurm_additional_parameters={"dependency": f"afterok:{first.job_id}"})
    second = ex.submit(stamp)
    assert job_state(second) == "PENDING"
    assert dependency_of(second.job_id).startswith(f"afterok:{first.job_id}")
    assert dependency_of(first.job_id) == ""
    first_end, second_start = wait_for([first, second], poll_s=0.2, timeout_s=60)
    assert second_start >= first_end


def test_cancelled_job_ends_the_wait(tmp_path, slurm_cluster):
    job = executor(tmp_path, slurm_cluster).submit(stamp_after, 120.0)
    t0 = time.monotonic()
    with pytest.raises(RegraftError, match=r"CANCELLED.*\(fix: .*resubmit"):
        wait_for([job], poll_s=0.2, timeout_s=60, on_state=lambda j, s: s == "RUNNING" and j.cancel())
    assert time.monotonic() - t0 < 30
    assert job_state(job) == "CANCELLED"


def test_exception_names_its_last_line_and_log(tmp_path, slurm_cluster):
    ex = executor(tmp_path, slurm_cluster)
    failing = ex.submit(boom, 42)
    ex.update_parameters(slurm_additional_parameters={"dependency": f"afterok:{failing.job_id}"})
    dependent = ex.submit(add, 1, 1)
    with pytest.raises(RegraftError) as err:
        wait_for([failing], poll_s=0.2, timeout_s=60)
    assert "FAILED" in str(err.value) and "ValueError: boom 42" in str(err.value)
    assert err.value.path == str(failing.paths.stderr) and Path(err.value.path).exists()
    assert job_state(failing) == "FAILED"
    # the job that needed it can never start: the wait cancels it and says why
    with pytest.raises(RegraftError, match=rf"DependencyNeverSatisfied.*afterok:{failing.job_id}"):
        wait_for([dependent], poll_s=0.2, timeout_s=60)
    wait_until(dependent, "CANCELLED")


def test_two_tasks_get_ranks_0_and_1(tmp_path, slurm_cluster):
    job = executor(tmp_path, slurm_cluster, tasks_per_node=2).submit(rank)
    assert wait_for([job], poll_s=0.2, timeout_s=60) == [[0, 1]]


def test_state_after_slurm_forgot_the_job_comes_from_its_results(tmp_path, slurm_cluster):
    ex = executor(tmp_path, slurm_cluster)
    ok, bad = ex.submit(add, 1, 2), ex.submit(boom, 1)
    with pytest.raises(RegraftError):
        wait_for([ok, bad], poll_s=0.2, timeout_s=60)
    wait_for([ok], poll_s=0.2, timeout_s=60)
    # the same result files under a job id slurmctld never had (as after MinJobAge has purged a job)
    for job, want in ((ok, "COMPLETED"), (bad, "FAILED")):
        ghost = tmp_path / f"ghost_{want}"
        ghost.mkdir()
        shutil.copy(job.paths.result_pickle, ghost / "999999_0_result.pkl")
        assert job_state(submitit.SlurmJob(folder=ghost, job_id="999999")) == want
    assert job_state("999999") == "UNKNOWN"
    never = submitit.SlurmJob(folder=tmp_path / "never", job_id="999999")  # no result either: the wait gives up
    with pytest.raises(RegraftError, match="unknown to Slurm for 1 s and wrote no result"):
        wait_for([never], poll_s=0.2, unknown_grace_s=1.0)


def test_time_limit_warning_ends_the_wait(tmp_path, slurm_cluster):
    # submitit asks Slurm for USR2 signal_delay_s (90) before the limit: with a 2-minute limit the warning is due
    # 30 s in and slurmctld sends it at its next time-limit check (every 30 s), and submitit's handler ends a
    # non-checkpointable job: FAILED. Not a 1-minute limit: its warning is due at once, and a check that comes
    # before submitit's srun step exists signals no one (Slurm sends the warning once), as a loaded CI machine showed
    job = executor(tmp_path, slurm_cluster, timeout_min=2).submit(stamp_after, 600.0)
    t0 = time.monotonic()
    with pytest.raises(RegraftError, match=r"FAILED after its time-limit warning.*timed-out.*\(fix: raise"):
        wait_for([job], poll_s=0.5, timeout_s=110)
    assert time.monotonic() - t0 < 100  # the kill would come at 120 s or later


@pytest.mark.long  # Slurm checks limits every 30 s: a real 1-minute limit takes 60-100 s to kill
def test_time_limit_kill_ends_the_wait(tmp_path, slurm_cluster):
    job = executor(tmp_path, slurm_cluster, timeout_min=1).submit(sleep_through_warning, 600.0)
    t0 = time.monotonic()
    with pytest.raises(RegraftError, match=r"ended TIMEOUT.*DUE TO TIME LIMIT.*\(fix: raise"):
        wait_for([job], poll_s=1.0, timeout_s=180)
    assert time.monotonic() - t0 < 150  # slurmctld checks limits every 30 s: killed 60-90 s after the start
    assert job_state(job) == "TIMEOUT"
