"""The `python` of a warm local job: hands the job to the warm interpreter (server.py) and stands in for it.

submitit's local controller runs `<this> <socket> -u -m submitit.core._submit <folder>`. This script, started
with `python -S` (standard library only, ~20 ms), sends the job's argv, environment, working directory and its
stdin/stdout/stderr to the server, which forks a child that already has torch imported. Signals sent to this
process (cancel, submitit's timeout warning) are forwarded to the child, and this process exits as the child did.
A signal this process was started ignoring stays ignored, here and in the child, as a plain interpreter would
inherit it; one that arrives before the child's pid is known is forwarded as soon as it is.
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


def ignored_signals() -> list[int]:
    return [int(number) for number in FORWARDED if signal.getsignal(number) == signal.SIG_IGN]


def hand_over(path: str, command: list[str], ignored: list[int]) -> socket.socket | None:
    """The connection on which the server took the job, or None when no server is there."""
    try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(path)
        payload = json.dumps({"argv": command, "env": dict(os.environ), "cwd": os.getcwd(),
                              "ignored_signals": ignored}).encode()
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


class Forwarder:
    """Signals for the child: held until its pid is known, then sent on as they come."""

    def __init__(self, ignored: list[int]):
        self.child: int | None = None
        self.held: list[int] = []
        for number in FORWARDED:
            if number not in ignored:
                signal.signal(number, self.receive)

    def receive(self, received: int, frame) -> None:
        if self.child is None:
            self.held.append(received)
        else:
            self.send(received)

    def send(self, number: int) -> None:
        try:
            os.kill(self.child, number)
        except ProcessLookupError:  # it has just ended; its status is on the way
            pass

    def start(self, child: int) -> None:
        self.child = child
        while self.held:
            self.send(self.held.pop(0))

    def stop(self) -> None:
        """Before this process becomes a plain interpreter: that one gets the held signals itself."""
        for number in FORWARDED:
            if signal.getsignal(number) == self.receive:
                signal.signal(number, signal.SIG_DFL)
        for number in self.held:
            os.kill(os.getpid(), number)


def main(path: str, command: list[str]) -> None:
    ignored = ignored_signals()
    forwarder = Forwarder(ignored)  # before the hand-over: no signal may fall between it and the child's pid
    connection = hand_over(path, command, ignored) if warm_shape(command) else None
    if connection is None:
        forwarder.stop()
        run_cold(command)
    replies = connection.makefile("rb")
    started = replies.readline().split()
    if len(started) != 2 or started[0] != b"pid":  # the server went away before it forked: nothing ran yet
        forwarder.stop()
        run_cold(command)
    child = int(started[1])
    forwarder.start(child)
    ended = replies.readline().split()
    if len(ended) != 2 or ended[0] != b"exit":
        print(f"error: the warm interpreter stopped while job process {child} ran; rerun to resume "
              "(launcher.warm=false runs jobs without it)", file=sys.stderr, flush=True)
        os._exit(1)
    exit_like(int(ended[1]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
