"""Job states and waiting for submitit jobs on Slurm, reliable without accounting (no slurmdbd, no sacct); the
executor that writes their batch scripts on any machine, and whether Slurm's commands are here to submit them.

In: submitit jobs (from `ScriptExecutor` or submitit's own `SlurmExecutor`) or Slurm job ids.
Out: their states, their `Dependency=`, and their results, or one `RegraftError` naming the log and the fix.

    from pipelines.launch.slurm_jobs import dependency_of, job_state, wait_for
    results = wait_for([vocab_job, remap_job])   # [result, result]; or RegraftError: "...: Slurm job 12 TIMEOUT ..."
    job_state(job)                               # "PENDING", "RUNNING", "COMPLETED", "FAILED", ..., "UNKNOWN"
    dependency_of(job.job_id)                    # "afterok:11(unfulfilled)"

Where a state comes from, in order: slurmctld's job table while it holds the job (`squeue -t all`, then
`scontrol show job`; a finished job stays there MinJobAge seconds, 300 by default), then the job's own submitit
result files (`<id>_<task>_result.pkl`: "success" is COMPLETED, "error" is FAILED), then `sacct` where
accounting exists, else "UNKNOWN".

Why not submitit's own watcher: `SlurmJob.watcher` (`SlurmInfoWatcher`) polls `sacct`; without slurmdbd every
call fails, it logs "Bypassing sacct error" and keeps the state UNKNOWN, which `is_done` counts as not done, so
`job.result()` of a cancelled or timed-out job (no result file) never returns. Overriding its command with squeue
was the other option and was rejected: (1) the watcher is a class attribute shared by every SlurmJob in the
process, so the override is a process-wide monkeypatch of private methods (`_make_command`, `read_info`);
(2) squeue forgets a job MinJobAge after it ends, and the watcher's UNKNOWN would again mean "wait forever" for a
job it did not catch in time, while its polling backs off to every 600 s; (3) it carries no pending reason, so a
DependencyNeverSatisfied job would also wait forever. This module therefore reads states itself and only uses
submitit for the result files (`Job._get_outcome_and_result`, called once a file exists, so it never blocks).
Never call `job.result()` on a job that may end without a result file; use `wait_for`.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import submitit

from pipelines.core.jobs import StageFailed, reported_error
from stages.common.contract.errors import RegraftError

# A job in one of these states may still produce a result.
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
                    "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"})
# Terminal states without a usable result, with what to do about each.
FIXES = {
    "FAILED": "read the log, fix the error and resubmit",
    "TIMEOUT": "raise the stage's timeout_min (Slurm --time) or make it checkpointable so it requeues",
    "CANCELLED": "it was cancelled (scancel, an admin, or a failed dependency); resubmit it",
    "NODE_FAIL": "the node died under the job; resubmit, and check the node with `sinfo -R`",
    "OUT_OF_MEMORY": "raise the stage's mem_gb (Slurm --mem)",
    "PREEMPTED": "it was preempted and not requeued; use a non-preemptible partition/QOS or make it checkpointable",
    "BOOT_FAIL": "the node failed to boot; resubmit, and check the node with `sinfo -R`",
    "DEADLINE": "it passed its --deadline; resubmit with a later one",
    "REVOKED": "a federated sibling took it; resubmit",
    "SPECIAL_EXIT": "the job asked to be held (special exit); fix it and `scontrol release` or resubmit",
}
# Pending reasons that can never clear by themselves: the job is cancelled and the wait ends.
NEVER_RUNS = {
    "DependencyNeverSatisfied": "an upstream job it depends on failed or was cancelled",
    "BadConstraints": "its constraints can never be met on this cluster",
}
LOG_NOISE = ("srun:",)  # srun's lines after the job's last words
SUBMITIT_TIMED_OUT = "not requeued because: timed-out"  # submitit's handler of the time-limit warning signal
REQUEUE_GRACE_S = 10.0  # a PREEMPTED job that is being requeued turns PENDING within this; else it is final


@dataclass(frozen=True)
class JobInfo:
    state: str           # Slurm's JobState, or "UNKNOWN"
    reason: str = ""     # pending reason ("Dependency", "DependencyNeverSatisfied", ...), when Slurm knows the job
    source: str = ""     # "squeue", "scontrol", "results", "sacct" or "" (unknown)


# What regraft runs on the machine it submits from: sbatch, and the state and cancel commands of this module.
COMMANDS = ("sbatch", "squeue", "scontrol", "scancel")


def missing_commands() -> list[str]:
    return [command for command in COMMANDS if shutil.which(command) is None]


class ScriptExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor without its look for `srun` on this machine (its constructor refuses a machine
    without one): the plan writes batch scripts anywhere, and a run asks for Slurm's commands itself
    (`missing_commands`, before any work), naming the fix. srun runs inside the job, on a node of the cluster."""

    @classmethod
    def affinity(cls) -> int:
        return 2

    def set_resources(self, resources: dict[str, Any]) -> None:
        """Set from AutoExecutor's names, as AutoExecutor does: its shared ones (`timeout_min`, `gpus_per_node`,
        `mem_gb`, ...) converted to sbatch's, `slurm_<option>` as `<option>`."""
        shared = {key: value for key, value in resources.items() if not key.startswith("slurm_")}
        own = {key[len("slurm_"):]: value for key, value in resources.items() if key.startswith("slurm_")}
        self.update_parameters(**self._convert_parameters(shared), **own)


def _run(argv: list[str]) -> str | None:
    """stdout of a Slurm client command, or None when it fails (unknown job, no slurmctld, no command)."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _squeue(job_ids: Sequence[str]) -> dict[str, JobInfo]:
    """One squeue call for many jobs. `-t all`: without it squeue hides finished jobs, even with -j."""
    out = _run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%r"])
    infos = {}
    for line in (out or "").splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            infos[parts[0]] = JobInfo(parts[1], "" if parts[2] == "None" else parts[2], "squeue")
    return infos


def _scontrol_fields(job_id: str) -> dict[str, str]:
    out = _run(["scontrol", "show", "job", "-o", str(job_id)])
    return dict(re.findall(r"(?:^|\s)(JobState|Reason|Dependency)=(\S*)", out or ""))


def _tasks(job: submitit.Job) -> list[submitit.Job]:
    return [job.task(k) for k in range(job.num_tasks)]


def _outcomes(job: submitit.Job) -> list[tuple[str, Any] | None]:
    """Each task's (outcome, result-or-trace) from submitit's result file, None where there is no file yet."""
    return [task._get_outcome_and_result() if task.paths.result_pickle.exists() else None for task in _tasks(job)]


def _from_results(job: submitit.Job) -> str | None:
    outcomes = _outcomes(job)
    if any(o is not None and o[0] == "error" for o in outcomes):
        return "FAILED"
    if outcomes and all(o is not None for o in outcomes):
        return "COMPLETED"
    return None


def job_info(job: submitit.Job | str, known: dict[str, JobInfo] | None = None) -> JobInfo:
    """State (and pending reason) of one job: squeue, scontrol, submitit's result files, sacct, else UNKNOWN.

    `job` is a submitit job or a Slurm job id (an id alone has no result files to fall back on); `known` holds
    answers of a batched squeue call already made.
    """
    job_id = job if isinstance(job, str) else job.job_id
    if known is not None and job_id in known:
        return known[job_id]
    if known is None:
        info = _squeue([job_id]).get(job_id)
        if info:
            return info
    fields = _scontrol_fields(job_id)
    if fields.get("JobState"):
        reason = fields.get("Reason", "")
        return JobInfo(fields["JobState"], "" if reason == "None" else reason, "scontrol")
    if not isinstance(job, str):
        state = _from_results(job)
        if state:
            return JobInfo(state, "", "results")
    out = _run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id])
    if out and out.split():
        return JobInfo(out.split()[0], "", "sacct")  # "CANCELLED by 0" -> "CANCELLED"
    return JobInfo("UNKNOWN")


def job_state(job: submitit.Job | str) -> str:
    """Slurm's JobState of a job ("PENDING", "RUNNING", "COMPLETED", "FAILED", "TIMEOUT", ...) or "UNKNOWN"."""
    return job_info(job).state


def dependency_of(job_id: str) -> str:
    """The job's `Dependency=` from `scontrol show job` ("afterok:12(unfulfilled)"); "" if none or job unknown."""
    dep = _scontrol_fields(job_id).get("Dependency", "")
    return "" if dep == "(null)" else dep


def _last_line(path: Path) -> str:
    """The line of a job's stderr log that says how it ended: Slurm's verdict ("*** JOB 8 ON node CANCELLED AT
    ... DUE TO TIME LIMIT ***") if it wrote one, else the last line the job wrote (srun's chatter skipped)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    verdict = [line for line in lines if line.startswith("slurmstepd") and "*** JOB" in line]
    if verdict:
        return verdict[0]
    own = [line for line in lines if not line.startswith(LOG_NOISE) and "Bypassing signal" not in line]
    return (own or lines or [""])[-1]


def _failure(job: submitit.Job, info: JobInfo) -> RegraftError:
    """The one-line error for a job that ended without a result (or with an exception)."""
    outcomes = _outcomes(job)
    failed = next((k for k, o in enumerate(outcomes) if o is not None and o[0] == "error"), None)
    task = job.task(failed if failed is not None else 0)
    log = task.paths.stderr
    own = reported_error(log)  # the stage's own line (pipelines/core/jobs.py), when it failed rather than was stopped
    if own and info.state in ("FAILED", "COMPLETED"):
        return StageFailed(own, log)
    last = ""
    if failed is not None:  # the exception's last line, from submitit's own record of it
        trace_lines = [line for line in str(outcomes[failed][1]).splitlines() if line.strip()]
        last = trace_lines[-1].strip() if trace_lines else ""
    last = last or _last_line(log)
    state = info.state
    where = f" (task {failed})" if failed is not None and job.num_tasks > 1 else ""
    problem = f"Slurm job {job.job_id}{where} ended {state}"
    if SUBMITIT_TIMED_OUT in last and state == "FAILED":
        problem += " after its time-limit warning"
    if last:
        problem += f"; last line: {last}"
    fix = FIXES.get(state, "read the log and resubmit")
    if SUBMITIT_TIMED_OUT in last:
        fix = FIXES["TIMEOUT"]
    return RegraftError(log, problem, fix)


def _collect(job: submitit.Job, info: JobInfo, results_timeout_s: float) -> Any:
    """Results of a COMPLETED job (a list for a multi-task job); waits briefly for result files on slow disks."""
    deadline = time.monotonic() + results_timeout_s
    while not all(t.paths.result_pickle.exists() for t in _tasks(job)) and time.monotonic() < deadline:
        time.sleep(0.5)
    outcomes = _outcomes(job)
    if any(o is not None and o[0] == "error" for o in outcomes):
        raise _failure(job, JobInfo("FAILED", info.reason, info.source))
    missing = [t for t, o in zip(_tasks(job), outcomes) if o is None]
    if missing:
        raise RegraftError(missing[0].paths.result_pickle, f"Slurm job {job.job_id} ended {info.state} but wrote "
                           "no result", f"read {missing[0].paths.stderr}; is the folder shared with the nodes?")
    values = [o[1] for o in outcomes]
    return values if job.num_tasks > 1 else values[0]


def wait_for(jobs: Sequence[submitit.Job], poll_s: float = 1.0,
             on_state: Callable[[submitit.Job, str], None] | None = None,
             unknown_grace_s: float = 120.0, timeout_s: float | None = None,
             results_timeout_s: float = 15.0) -> list[Any]:
    """Wait for submitit jobs on Slurm and return their results in order (a list per multi-task job).

    Raises one RegraftError, as soon as any job ends without a result: FAILED (with the exception's last line
    and the stderr log), TIMEOUT, CANCELLED, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED (not requeued), ...; pending
    with a reason that never clears (DependencyNeverSatisfied: the job is scancelled first); unknown to Slurm
    with no result file for `unknown_grace_s` (slurmctld down, or the job purged before it was seen); or still
    unfinished after `timeout_s` (None: no limit; jobs keep running). Other jobs are left as they are.
    `on_state(job, state)` is called on each job's every change of state.
    """
    if shutil.which("squeue") is None:
        raise RegraftError(None, "squeue is not on PATH, so Slurm jobs cannot be watched",
                           "run on a Slurm login node, or use the local launcher")
    results: dict[int, Any] = {}
    seen: dict[int, str] = {}
    doubtful_since: dict[tuple[int, str], float] = {}
    start = time.monotonic()
    while len(results) < len(jobs):
        waiting = {i: job for i, job in enumerate(jobs) if i not in results}
        known = _squeue(sorted({job.job_id for job in waiting.values()}))
        for i, job in waiting.items():
            info = job_info(job, known)
            if on_state is not None and seen.get(i) != info.state:
                on_state(job, info.state)
            seen[i] = info.state
            if info.state == "COMPLETED":
                results[i] = _collect(job, info, results_timeout_s)
            elif info.state in ACTIVE:
                doubtful_since.pop((i, "UNKNOWN"), None)
                doubtful_since.pop((i, "PREEMPTED"), None)
                if info.state == "PENDING" and info.reason in NEVER_RUNS:
                    dependency = dependency_of(job.job_id)
                    subprocess.run(["scancel", job.job_id], capture_output=True, timeout=30)
                    detail = f" (Dependency={dependency})" if dependency else ""
                    raise RegraftError(job.paths.folder, f"Slurm job {job.job_id} can never start: "
                                       f"{info.reason}{detail}, {NEVER_RUNS[info.reason]}; it was cancelled",
                                       "fix the upstream job and resubmit the chain")
            elif info.state in ("UNKNOWN", "PREEMPTED"):  # final only once it has stayed so for a while
                since = doubtful_since.setdefault((i, info.state), time.monotonic())
                grace = unknown_grace_s if info.state == "UNKNOWN" else REQUEUE_GRACE_S
                if time.monotonic() - since <= grace:
                    continue
                if info.state == "PREEMPTED":
                    raise _failure(job, info)
                raise RegraftError(job.paths.folder, f"Slurm job {job.job_id} has been unknown to Slurm for "
                                   f"{unknown_grace_s:.0f} s and wrote no result",
                                   "check that slurmctld answers (`sinfo`) and read the job's logs here")
            else:
                raise _failure(job, info)
        if len(results) < len(jobs):
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                late = [f"{jobs[i].job_id} {seen.get(i, 'UNKNOWN')}" for i in range(len(jobs)) if i not in results]
                raise RegraftError(jobs[0].paths.folder, f"Slurm jobs still unfinished after {timeout_s:.0f} s: "
                                   + ", ".join(late), "wait longer (timeout_s) or look at `squeue`")
            time.sleep(poll_s)
    return [results[i] for i in range(len(jobs))]
