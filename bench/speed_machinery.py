"""Benchmark: what the speed machinery buys and what it costs, the figures its defaults are chosen from.

- The local launcher's warm interpreter (`launcher.warm`, pipelines/launch/warm/): a cold run with it and without
  it, each on fresh outputs: the run's wall seconds and its jobs' overhead (each job's wall seconds less the stage's
  own, summed).
- The store's agent (`tracking.agent`, pipelines/tracking/store_agent.py): a warm rerun (every stage a cache hit) with
  it and without it, median of `--repeat`, on the run's own sqlite store and on a real `mlflow server` (an http
  store, as a team shares one); and the command that starts the agent, which pays what a command without it pays.
- What each costs: its lines of code, and the processes it leaves running once the command has returned (the
  warm interpreters started and not ended; the store's own agent up or not).

    .venv/bin/python bench/speed_machinery.py                      # the default run: two cold runs, ~10 min on 2 cores
    .venv/bin/python bench/speed_machinery.py --override debug=tiny
    .venv/bin/python bench/speed_machinery.py --write              # docs/speed.md's figures:speed-machinery block
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.figures import code_commit, cpu_model, write_blocks  # noqa: E402

BLOCK = "speed-machinery"
MACHINERY = {"launcher.warm": ["pipelines/launch/warm"], "tracking.agent": ["pipelines/tracking/store_agent.py"]}
WARM_SERVER = "pipelines.launch.warm.server"
SERVER_START_S = 120.0


def regraft(outputs: Path, *overrides: str) -> float:
    """One `regraft` command's wall seconds; a failed one ends the benchmark with its output."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipelines.regraft", f"paths.outputs={outputs}", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"regraft {' '.join(overrides)} exited {done.returncode}:\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    return time.perf_counter() - started


def newest_summary(outputs: Path) -> dict:
    summary = sorted((outputs / "runs").glob("*/summary.json"), key=lambda path: path.parent.name)[-1]
    return json.loads(summary.read_text())


def running(module: str) -> int:
    """Processes of this user running `python -m <module>` (what else runs here may start some too)."""
    count = 0
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and proc.stat().st_uid == os.getuid() and \
                    module in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                count += 1
    return count


def lines_of(paths: list[str]) -> int:
    files = [file for path in paths for file in ((ROOT / path).rglob("*.py") if (ROOT / path).is_dir()
                                                  else [ROOT / path])]
    return sum(1 for file in files for line in file.read_text().splitlines() if line.strip())


def cold_run(overrides: list[str], warm: bool, outputs: Path) -> dict:
    """A run with nothing cached; the warm interpreters it leaves running once it returned."""
    before = running(WARM_SERVER)
    wall = regraft(outputs, f"launcher.warm={str(warm).lower()}", *overrides)
    summary = newest_summary(outputs)
    ran = [stage for stage in summary["stages"].values() if not stage["hit"]]
    return {"wall": wall, "jobs": len(ran), "overhead": sum(stage.get("overhead_seconds") or 0.0 for stage in ran),
            "left": running(WARM_SERVER) - before}


def agent_listening(outputs: Path, overrides: list[str]) -> int:
    """1 if the store's own agent (the one these commands reach) is up, else 0."""
    from hydra import compose, initialize_config_dir

    import pipelines.regraft  # noqa: F401  (registers every schema, for compose)
    from pipelines.tracking.store_agent import agent_settings, listening, socket_path
    from stages.common.contract.stage import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.outputs={outputs}", *overrides])
    return int(listening(socket_path(agent_settings(cfg.tracking))))


def reruns(outputs: Path, overrides: list[str], repeat: int, agent: bool) -> dict:
    """Warm reruns on a complete outputs folder: the first (with the agent on, it starts one) and the median of the
    rest."""
    from pipelines.tracking.store_agent import stop_agents

    stop_agents(str(outputs))
    flag = f"tracking.agent={str(agent).lower()}"
    first = regraft(outputs, flag, *overrides)
    walls = [regraft(outputs, flag, *overrides) for _ in range(repeat)]
    if not all(stage["hit"] for stage in newest_summary(outputs)["stages"].values()):
        raise SystemExit(f"the rerun in {outputs} ran stages: not a warm rerun")
    return {"first": first, "median": statistics.median(walls), "left": agent_listening(outputs, [flag, *overrides])}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """A real `mlflow server` on a sqlite file in `folder`; its URI while it runs."""
    port = free_port()
    log = (folder / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
                               "--default-artifact-root", str(folder / "artifacts"), "--workers", "1"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"mlflow server did not answer at {uri} within {SERVER_START_S:.0f} s "
                                 f"(its log: {folder / 'server.log'})")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
        log.close()


def measure(overrides: list[str], repeat: int, keep: Path) -> dict:
    figures = {"cold": {}, "rerun": {}}
    for warm in (True, False):
        figures["cold"][warm] = cold_run(overrides, warm, keep / f"cold_warm_{str(warm).lower()}")
    outputs = keep / "cold_warm_true"
    for agent in (True, False):
        figures["rerun"][("sqlite", agent)] = reruns(outputs, overrides, repeat, agent)
    with mlflow_server(keep) as uri:
        for agent in (True, False):
            figures["rerun"][("http", agent)] = reruns(outputs, [f"tracking.uri={uri}", *overrides], repeat, agent)
    from pipelines.tracking.store_agent import stop_agents

    stop_agents(str(outputs))
    return figures


def table(figures: dict) -> str:
    cold, rerun = figures["cold"], figures["rerun"]
    rows = [("a cold run (launcher.warm), wall", cold[True]["wall"], cold[False]["wall"]),
            (f"  its {cold[True]['jobs']} jobs' overhead, summed", cold[True]["overhead"], cold[False]["overhead"])]
    for store in ("sqlite", "http"):
        rows.append((f"a warm rerun, {store} store (tracking.agent), median", rerun[(store, True)]["median"],
                     rerun[(store, False)]["median"]))
        rows.append(("  the command that starts the agent", rerun[(store, True)]["first"], None))
    width = max(len(row[0]) for row in rows) + 2
    lines = [f"{'seconds':<{width}}{'on':>8}{'off':>8}{'bought':>8}"]
    blank = " " * 8
    for name, on, off in rows:
        off_text, bought = (f"{off:8.1f}", f"{off - on:8.1f}") if off is not None else (blank, blank)
        lines.append(f"{name:<{width}}{on:8.1f}{off_text}{bought}")
    lines += ["", f"{'what it costs':<{width}}{'lines':>8}   processes a command leaves running"]
    left = {"launcher.warm": f"{cold[True]['left']}",
            "tracking.agent": f"{rerun[('sqlite', True)]['left']} (sqlite), {rerun[('http', True)]['left']} (http), "
                              "each until tracking.agent_idle_s without a command"}
    for name, paths in MACHINERY.items():
        lines.append(f"{name:<{width}}{lines_of(paths):8d}   {left[name]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--override", action="append", default=[], help="a regraft override for every command")
    parser.add_argument("--repeat", type=int, default=3, help="warm reruns per case (the median is reported)")
    parser.add_argument("--write", action="store_true", help=f"write docs/speed.md's figures:{BLOCK} block")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="regraft-speed-") as folder:
        text = table(measure(args.override, args.repeat, Path(folder)))
    command = " ".join(["bench/speed_machinery.py", *(f"--override {o}" for o in args.override), "--write"])
    block = (f"```\n{text}\n```\n\n`{command}`, written by the script on {datetime.date.today()} at commit "
             f"{code_commit()} ({os.cpu_count()} cores of {cpu_model()}; overrides: "
             f"{' '.join(args.override) or 'none'}; {args.repeat} reruns per case).")
    print(block)
    if args.write:
        write_blocks({BLOCK: block})


if __name__ == "__main__":
    main()
