"""The demo's processes: a broker and the two services, each a real OS process that can be
killed with SIGKILL and started again (the broker on the same store and port)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["ROOT", "Proc", "free_port"]

ROOT = Path(__file__).resolve().parents[2]


def _ephemeral_low() -> int:
    """The lowest port the system hands out to outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152


def free_port() -> int:
    """A free port below the ephemeral range, for a server that restarts on its port.

    A port from the ephemeral range (what binding port 0 gives) can be taken while the
    server is down — by any outgoing connection, or by a client reconnecting to it, which
    then connects to itself — and the restarted server could not bind it again.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # crowded: any port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """``python -m <args>`` from the repository root; stdout lines are collected (wait for
    one with :meth:`wait_line`), stderr goes to ``log``."""

    def __init__(
        self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.args = args
        self.log = log
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        with log.open("a") as err:
            err.write(f"--- {name}: {' '.join(args)}\n")
            err.flush()
            self.popen = subprocess.Popen(
                [sys.executable, "-m", *args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=ROOT,
                env={
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "PYTHONUNBUFFERED": "1",
                    **(env or {}),
                },
            )
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with self.popen.stdout:
            for line in self.popen.stdout:
                with self._cond:
                    self.lines.append(line.rstrip("\n"))
                    self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_line(self, prefix: str, timeout: float = 60.0, skip: int = 0) -> str:
        """The first stdout line starting with ``prefix`` (after the first ``skip`` lines);
        raises if the process ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[skip:]:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = f"exited with {self.popen.poll()}" if self._eof else "timed out"
                    raise RuntimeError(
                        f"{self.name} {why} before printing {prefix!r}; the end of "
                        f"{self.log}:\n{self.log_tail()}"
                    )
                self._cond.wait(left)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"({exc})"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.popen.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crash."""
        if self.alive:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(30)
        self._reader.join(10)

    def pause(self) -> None:
        """SIGSTOP: the process stops where it is (as under a long GC pause, or a VM's)."""
        self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: a paused process goes on."""
        if self.alive:
            self.popen.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (a paused process resumed first), then SIGKILL if it does not end in
        time."""
        if self.alive:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(10)
