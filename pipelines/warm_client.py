"""The `python` of a warm local job: hands the job to the warm interpreter (pipelines/warm.py) and stands in for it.

submitit's local controller runs `<this> <socket> -u -m submitit.core._submit <folder>`. This script, started
with `python -S` (standard library only, ~20 ms), sends the job's argv, environment, working directory and its
stdin/stdout/stderr to the server, which forks a child that already has torch imported. Signals sent to this
process (cancel, submitit's timeout warning) are forwarded to the child, and this process exits as the child did.
When no server answers, it becomes the plain interpreter (exec), so a job never depends on the server.
"""
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def run_cold(command: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *command])


def warm_shape(command: list[str]) -> bool:
    """`[-u] -m MODULE ARGS...`: what submitit runs, and all the server takes."""
    return "-m" in command and all(option == "-u" for option in command[:command.index("-m")]) \
        and len(command) > command.index("-m") + 1


def hand_over(path: str, command: list[str]) -> socket.socket | None:
    """The connection on which the server took the job, or None when no server is there."""
    try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(path)
        payload = json.dumps({"argv": command, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(connection, [struct.pack("!Q", len(payload))], [0, 1, 2])
        connection.sendall(payload)
        return connection
    except OSError:
        return None


def exit_like(code: int) -> None:
    """Exit with the child's status; a child killed by a signal is reported as killed by the same signal."""
    sys.stdout.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def main(path: str, command: list[str]) -> None:
    connection = hand_over(path, command) if warm_shape(command) else None
    if connection is None:
        run_cold(command)
    replies = connection.makefile("rb")
    started = replies.readline().split()
    if len(started) != 2 or started[0] != b"pid":  # the server went away before it forked: nothing ran yet
        run_cold(command)
    child = int(started[1])

    def forward(received: int, frame) -> None:
        try:
            os.kill(child, received)
        except ProcessLookupError:  # it has just ended; its status is on the way
            pass

    for number in FORWARDED:
        signal.signal(number, forward)
    ended = replies.readline().split()
    if len(ended) != 2 or ended[0] != b"exit":
        print(f"error: the warm interpreter stopped while job process {child} ran; rerun to resume "
              "(launcher.warm=false runs jobs without it)", file=sys.stderr, flush=True)
        os._exit(1)
    exit_like(int(ended[1]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
