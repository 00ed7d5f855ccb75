"""A real two-node Slurm cluster on this one machine (Debian's slurm-wlm 22.05 + munge) as a session-scoped
pytest fixture.

Debian's Slurm is built with multiple-slurmd support: two slurmd, `n1` (NodeAddr 127.0.0.1) and `n2` (127.0.0.2),
each on its own port and each in its own UTS and mount namespace (`unshare`), where its hostname is its node name
and a private hosts file (bind-mounted over /etc/hosts inside the namespace only; the real one is never touched)
maps n1 and n2 to their addresses. Every task a slurmd starts inherits that view, so a 2-node job's ranks see two
hosts, and submitit's rendezvous (the allocation's first host) resolves on both. Each slurmd reports the whole
machine, so each node is configured with what the machine has and half its memory.

In: a root shell on Debian/Ubuntu; the packages are installed with apt when `slurmctld` is missing (about 10 s).
Out: `slurm_cluster`, a `SlurmCluster` (conf path, partition, env, folder); `SLURM_CONF` is exported into
`os.environ` for the session, so `sbatch`/`squeue` and submitit's `SlurmExecutor` talk to this cluster.
tests/conftest.py imports it, so every test file shares one cluster: ask for `slurm_cluster` and mark the test
`slurm` (the mark also keeps every Slurm test on one xdist worker).

Everything lives in one folder per session, `/tmp/regraft-slurm/<session>/`: a private munge key and socket
(`AuthInfo=socket=...`, so the system's munged, if any, is neither needed nor touched), slurm.conf on free ports,
state, spool, logs and one pid file per daemon started. A folder whose owner (the pytest process that made it)
is dead belongs to a crashed run: its daemons are stopped (by the pids recorded there, checked against their
command line) and the folder removed. At the end every daemon this session started is stopped by pid, after
its jobs are cancelled, and the environment is restored. If the packages cannot be installed or the daemons do
not come up, the tests that use the fixture are skipped with the reason and the log to read.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PARTITION = "debug"
BASE = Path(tempfile.gettempdir()) / "regraft-slurm"
NODES = {"n1": "127.0.0.1", "n2": "127.0.0.2"}
DAEMONS = ("munged", "slurmctld", *(f"slurmd-{name}" for name in NODES))  # start order; stopped in reverse
UP_TIMEOUT_S = 30.0


@dataclass
class SlurmCluster:
    conf: Path          # the generated slurm.conf (also in os.environ["SLURM_CONF"] while the session runs)
    partition: str      # the only partition, the default one
    env: dict[str, str]  # what the fixture put into os.environ
    folder: Path        # state, spool, logs, pid files
    cpus: int           # CPUs of each node (n1, n2): the whole machine's
    nodes: tuple[str, ...] = tuple(NODES)
    pids: dict[str, int] = field(default_factory=dict)   # the daemons this session started
    notes: list[str] = field(default_factory=list)       # stale daemons of crashed sessions stopped at start

    def log(self, daemon: str) -> Path:
        return self.folder / f"{daemon}.log"


# ---- packages ------------------------------------------------------------------------------------------------

def _missing() -> list[str]:
    return [b for b in ("slurmctld", "slurmd", "sbatch", "srun", "munged") if shutil.which(b) is None
            and not Path("/usr/sbin", b).exists()]


def ensure_installed() -> str | None:
    """Install the Slurm packages with apt if `slurmctld` is missing; return why not, or None when usable."""
    if not _missing():
        return None
    if os.geteuid() != 0:
        return f"Slurm is not installed ({', '.join(_missing())} missing) and installing it needs root"
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=60",
               *PACKAGES]
    out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:  # a clean machine may need the package lists first
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or _missing():
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"apt-get install {' '.join(PACKAGES)} failed: {tail[0]}"
    return None


# ---- processes -----------------------------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie counts as dead
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stop(pid: int, marker: str, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, the process `pid` if its command line contains `marker` (guards against pid reuse)."""
    if not _alive(pid) or marker not in _cmdline(pid):
        return
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:  # reap it if it is our child
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            if not _alive(pid):
                return
            time.sleep(0.1)


def _daemon_alive(folder: Path, name: str) -> bool:
    try:
        pid = int((folder / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return False
    return _alive(pid) and str(folder) in _cmdline(pid)


def _cancel_jobs(folder: Path) -> str:
    """scancel a stale cluster's jobs; a controller that no longer answers (scancel retries it for minutes) is
    noted and passed over, its daemons are stopped next either way."""
    try:
        subprocess.run(["scancel", "--quiet", f"--partition={PARTITION}"], capture_output=True, timeout=15,
                       env={**os.environ, "SLURM_CONF": str(folder / "slurm.conf")})
        return f"cancelled the jobs of {folder}"
    except subprocess.TimeoutExpired:
        return f"scancel gave up on {folder} after 15 s (its slurmctld does not answer)"


def reap_stale(base: Path = BASE) -> list[str]:
    """Stop the daemons of crashed sessions (folder owner dead) and remove their folders; return what was done."""
    done = []
    for folder in sorted(base.glob("s-*")):
        try:
            owner = int((folder / "owner.pid").read_text())
        except (OSError, ValueError):
            owner = 0
        if owner and _alive(owner):
            continue  # another live session
        if not owner and time.time() - folder.stat().st_mtime < 60:
            continue  # a session still writing its owner.pid
        if (folder / "slurm.conf").exists() and _daemon_alive(folder, "slurmctld"):
            done.append(_cancel_jobs(folder))  # its jobs first, so no slurmstepd outlives its slurmd
        for name in reversed(DAEMONS):
            try:
                pid = int((folder / f"{name}.pid").read_text())
            except (OSError, ValueError):
                continue
            if _alive(pid) and str(folder) in _cmdline(pid):
                _stop(pid, str(folder))
                done.append(f"stopped stale {name} {pid} of {folder}")
        shutil.rmtree(folder, ignore_errors=True)
    return done


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"(no {path.name})"
    return " | ".join(lines[-n:]) or f"({path.name} is empty)"


# ---- configuration -------------------------------------------------------------------------------------------

def real_memory_mb() -> int:
    """Half the machine's memory: slurmd drains a node that reports less than RealMemory, never one with more."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return max(256, total // 2)


def slurm_conf(folder: Path, ctld_port: int, slurmd_ports: list[int], cpus: int, memory_mb: int) -> str:
    f = folder
    nodes = "\n".join(f"NodeName={name} NodeHostname={name} NodeAddr={address} Port={port} CPUs={cpus} "
                      f"RealMemory={memory_mb} State=UNKNOWN"
                      for (name, address), port in zip(NODES.items(), slurmd_ports))
    return f"""\
# Generated by tests/slurm_cluster.py for one pytest session.
ClusterName=regraft-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={f}/munge/munge.sock
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool/%n
SlurmctldPidFile={f}/slurmctld.daemon.pid
SlurmdPidFile={f}/slurmd.%n.daemon.pid
SlurmctldLogFile={f}/slurmctld.log
SlurmdLogFile={f}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
SchedulerType=sched/backfill
# schedule on every submit and job end, and look again every second (a dependency freed by a job's end)
SchedulerParameters=sched_interval=1,batch_sched_delay=0,sched_min_interval=0
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=10
InactiveLimit=0
KillWait=2
WaitTime=0
# a finished job stays in squeue/scontrol at least this long (slurmctld purges about once a minute), long
# enough for any poller to see its final state; after that its state comes from the job's own files
MinJobAge=60
{nodes}
PartitionName={PARTITION} Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


# ---- the cluster ---------------------------------------------------------------------------------------------

class _Session:
    def __init__(self) -> None:
        BASE.mkdir(parents=True, exist_ok=True)
        BASE.chmod(0o755)  # munged wants every directory above its socket searchable by all
        self.notes = reap_stale()
        self.folder = Path(tempfile.mkdtemp(prefix="s-", dir=BASE))
        self.folder.chmod(0o755)
        (self.folder / "owner.pid").write_text(str(os.getpid()))
        self.procs: dict[str, subprocess.Popen] = {}

    def _start(self, name: str, argv: list[str], **kw) -> None:
        log = open(self.folder / f"{name}.out", "wb")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, **kw)
        log.close()
        self.procs[name] = proc
        (self.folder / f"{name}.pid").write_text(str(proc.pid))

    def _check_running(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise _Down(f"{name} exited with {proc.returncode}: {_tail(self.folder / f'{name}.out')} "
                        f"(log: {self.folder / (name + '.log')})")

    def start_munged(self) -> None:
        mdir = self.folder / "munge"
        mdir.mkdir()
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(128))  # a private key: nothing outside this session can use the socket
        key.chmod(0o600)
        shutil.chown(mdir, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        munged = shutil.which("munged") or "/usr/sbin/munged"
        self._start("munged", [munged, "-F", f"--socket={mdir}/munge.sock", f"--key-file={key}",
                               f"--pid-file={mdir}/munged.pid", f"--log-file={self.folder}/munged.log",
                               f"--seed-file={mdir}/munged.seed"],
                    user="munge", group="munge", extra_groups=[])
        self._wait(lambda: (mdir / "munge.sock").exists(), "munged", 10)

    def _wait(self, ready, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            self._check_running(name)
            if time.monotonic() > deadline:
                raise _Down(f"{name} not ready after {timeout_s:.0f} s: {_tail(self.folder / (name + '.log'))}")
            time.sleep(0.2)

    def start_slurm(self) -> SlurmCluster:
        cpus = os.cpu_count() or 1
        ctld_port, *slurmd_ports = _free_ports(1 + len(NODES))
        for d in ("state", *(f"spool/{name}" for name in NODES)):
            (self.folder / d).mkdir(parents=True)
        conf = self.folder / "slurm.conf"
        conf.write_text(slurm_conf(self.folder, ctld_port, slurmd_ports, cpus, real_memory_mb() // len(NODES)))
        hosts = self.folder / "hosts"  # what every node's namespace sees as /etc/hosts
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in NODES.items()))
        env = {"SLURM_CONF": str(conf)}
        self.saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        sbin = "/usr/sbin"
        self._start("slurmctld", [shutil.which("slurmctld") or f"{sbin}/slurmctld", "-D", "-i", "-f", str(conf)])
        slurmd = shutil.which("slurmd") or f"{sbin}/slurmd"
        for name in NODES:  # unshare execs sh, sh execs slurmd: the pid recorded is slurmd's
            inside = f"hostname {name} && mount --bind {hosts} /etc/hosts && exec {slurmd} -D -N {name} -f {conf}"
            self._start(f"slurmd-{name}", ["unshare", "--uts", "--mount", "--propagation", "private",
                                           "sh", "-c", inside])
        cluster = SlurmCluster(conf=conf, partition=PARTITION, env=env, folder=self.folder, cpus=cpus,
                               pids={name: p.pid for name, p in self.procs.items()}, notes=self.notes)
        self._wait(lambda: self._node_states() == ["idle"] * len(NODES), "slurmd-n1", UP_TIMEOUT_S)
        return cluster

    def _node_states(self) -> list[str]:
        for name in DAEMONS[1:]:
            self._check_running(name)
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=15)
        return sorted(out.stdout.split())

    def stop(self, keep_folder: bool = False) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--quiet", f"--partition={PARTITION}"], capture_output=True, timeout=15)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=15)
                if out.returncode != 0 or not out.stdout.strip():
                    break
                time.sleep(0.5)
        for name in reversed(DAEMONS):
            if name in self.procs:
                _stop(self.procs[name].pid, str(self.folder))
                try:
                    self.procs[name].wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for k, v in getattr(self, "saved_env", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not keep_folder:  # kept for its logs when the cluster did not come up (the next session removes it)
            shutil.rmtree(self.folder, ignore_errors=True)


class _Down(Exception):
    pass


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its daemons as root (SlurmUser=root) and munged as user munge")
    session = _Session()
    try:
        session.start_munged()
        cluster = session.start_slurm()
    except (_Down, OSError, subprocess.SubprocessError) as e:
        session.stop(keep_folder=True)
        pytest.skip(f"the two-node Slurm cluster did not come up: {e}")
    try:
        yield cluster
    finally:
        session.stop()
