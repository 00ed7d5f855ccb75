"""The warm interpreter (pipelines/launch/warm/server.py): jobs forked from one process that imported torch once behave as jobs
started by a fresh interpreter do (streams, environment, exit status, signals, submitit results), and nothing
outlives what it belongs to."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cloudpickle
import pytest
import submitit

from pipelines.launch.warm.server import WarmInterpreter

ROOT = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent("""
    import os, sys, time
    already = "torch" in sys.modules  # before this job imports anything
    import torch
    print("job", already, os.getcwd(), os.environ.get("REGRAFT_TEST"), torch.get_num_threads(), os.getppid(),
          os.getpid(), sys.argv[1:], flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    if sys.argv[1] == "raise":
        raise ValueError("the job's own failure")
    sys.exit(int(sys.argv[2]))
""")


@pytest.fixture(scope="module", autouse=True)
def interruptible():
    """Jobs started here get SIGINT as a terminal's python does, even when the suite itself was started with it
    ignored (a background job of a non-interactive shell, as CI may run it): every child inherits an ignore."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> WarmInterpreter:
    interpreter = WarmInterpreter([], tmp_path_factory.mktemp("warm") / "warm.log")
    yield interpreter
    interpreter.stop()


@pytest.fixture
def job_dir(tmp_path) -> Path:
    (tmp_path / "warm_test_job.py").write_text(JOB)
    return tmp_path


def start(python: str, job_dir: Path, *args: str, ignoring_sigint: bool = False, **streams) -> subprocess.Popen:
    env = dict(os.environ, REGRAFT_TEST="hello", OMP_NUM_THREADS="1")
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignoring_sigint else None
    return subprocess.Popen([*shlex.split(python), "-u", "-m", "warm_test_job", *args], cwd=job_dir, env=env,
                            text=True, preexec_fn=ignore, **streams)


def run(python: str, job_dir: Path, *args: str) -> tuple[int, list[str], str]:
    with (job_dir / "out").open("w") as out, (job_dir / "err").open("w") as err:
        code = start(python, job_dir, *args, stdout=out, stderr=err).wait(timeout=120)
    return code, (job_dir / "out").read_text().split(), (job_dir / "err").read_text()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def children_of(pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()


def wait_until(condition, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_warm_job_is_a_fork_of_the_server_with_the_jobs_own_streams_environment_and_exit_status(warm, job_dir):
    code, out, err = run(warm.python(), job_dir, "go", "3")
    assert code == 3
    assert out[:5] == ["job", "True", str(job_dir), "hello", "1"]  # torch was there already; OMP_NUM_THREADS holds
    assert int(out[5]) == warm.process.pid and out[7:] == ["['go',", "'3']"]
    assert err == "to stderr\n"


def test_a_cold_interpreter_gives_the_same_job_the_same_answers_but_imports_torch_itself(warm, job_dir):
    code, out, err = run(shlex.quote(sys.executable), job_dir, "go", "3")
    assert code == 3 and out[:5] == ["job", "False", str(job_dir), "hello", "1"] and err == "to stderr\n"


def test_failures_and_signals_end_a_warm_job_as_they_end_a_plain_python(warm, job_dir):
    code, _, err = run(warm.python(), job_dir, "raise", "0")
    assert code == 1 and "ValueError: the job's own failure" in err
    job = start(warm.python(), job_dir, "sleep", "0", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child = int(job.stdout.readline().split()[6])
    job.send_signal(signal.SIGINT)  # forwarded to the forked child, which dies of it as python does
    assert job.wait(timeout=30) == -signal.SIGINT
    assert "KeyboardInterrupt" in job.stderr.read()
    assert wait_until(lambda: not alive(child))


@pytest.mark.parametrize("interpreter", ["warm", "cold"])
def test_a_job_started_ignoring_sigint_ignores_it_warm_as_cold(warm, job_dir, interpreter):
    """What LocalLauncher relies on: jobs are started with SIGINT ignored, so a terminal's Ctrl-C reaches regraft
    alone; a warm job must ignore it as a plain interpreter does, and still end on SIGTERM."""
    python = warm.python() if interpreter == "warm" else shlex.quote(sys.executable)
    job = start(python, job_dir, "sleep", "0", ignoring_sigint=True, stdout=subprocess.PIPE)
    child = int(job.stdout.readline().split()[6])
    job.send_signal(signal.SIGINT)
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(timeout=2)
    assert alive(child)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == -signal.SIGTERM and wait_until(lambda: not alive(child))


def caught_signals(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("SigCgt:")[1].split()[0], 16)


def forked_children(pid: int) -> set[int]:
    return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def test_a_signal_sent_before_the_child_is_known_still_reaches_it(warm, job_dir):
    """The client forwards from its first instruction on: a signal that arrives before the server has forked is
    held and sent on, not lost. The server is stopped meanwhile, so the signal surely comes first."""
    os.kill(warm.process.pid, signal.SIGSTOP)
    try:
        job = start(warm.python(), job_dir, "sleep", "0", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # python catches SIGINT itself; SIGTERM only once the client's forwarder is in place
        assert wait_until(lambda: caught_signals(job.pid) & (1 << (signal.SIGTERM - 1)))
        job.send_signal(signal.SIGINT)
    finally:
        os.kill(warm.process.pid, signal.SIGCONT)
    assert job.wait(timeout=30) == -signal.SIGINT
    assert "KeyboardInterrupt" in job.stderr.read()


def test_a_signal_sent_as_the_child_is_forked_still_reaches_it(warm, job_dir):
    """The client has the pid as soon as the server forks, maybe before the child has run at all; a signal sent
    on then must reach the job too (python's fork drops one that lands before the child's first instruction)."""
    for _ in range(8):
        before = forked_children(warm.process.pid)
        job = start(warm.python(), job_dir, "sleep", "0", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not forked_children(warm.process.pid) - before and time.monotonic() < deadline:
            pass  # no sleep: the moment of the fork is what this test is about
        job.send_signal(signal.SIGINT)
        assert job.wait(timeout=30) == -signal.SIGINT


def test_a_killed_client_takes_its_job_with_it_and_the_server_goes_on(warm, job_dir):
    job = start(warm.python(), job_dir, "sleep", "0", stdout=subprocess.PIPE)
    child = int(job.stdout.readline().split()[6])
    job.kill()  # what submitit's controller does last when it cancels a job
    job.wait()
    assert wait_until(lambda: not alive(child))
    assert run(warm.python(), job_dir, "go", "0")[0] == 0


def test_submitit_local_jobs_run_warm_and_cancel(warm, tmp_path):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    executor = submitit.LocalExecutor(folder=tmp_path / "%j", python=warm.python())
    executor.update_parameters(timeout_min=5)
    job = executor.submit(job_facts, 21)
    assert job.result() == (42, True, warm.process.pid)
    sleeper = executor.submit(time.sleep, 60)
    assert wait_until(lambda: children_of(warm.process.pid))
    sleeper.cancel()
    assert wait_until(sleeper.done) and not sleeper.paths.result_pickle.exists()
    assert wait_until(lambda: not children_of(warm.process.pid))


def job_facts(value: int) -> tuple[int, bool, int]:
    return value * 2, "torch" in sys.modules, os.getppid()


def test_without_a_server_the_client_runs_the_job_itself(tmp_path, job_dir):
    interpreter = WarmInterpreter([], tmp_path / "warm.log")
    client = interpreter.python()
    interpreter.stop()
    assert interpreter.python() == shlex.quote(sys.executable)
    code, out, _ = run(client, job_dir, "go", "5")  # the socket is gone: the client execs a plain interpreter
    assert code == 5 and out[1] == "False"


def test_the_server_stops_with_the_process_that_started_it(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from pipelines.launch.warm.server import WarmInterpreter
        warm = WarmInterpreter([], Path({str(tmp_path / 'warm.log')!r}))
        print(warm.process.pid, flush=True)
        import time; time.sleep(600)
    """)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server = int(owner.stdout.readline())
    owner.kill()
    owner.wait()
    assert wait_until(lambda: not alive(server), 30)
