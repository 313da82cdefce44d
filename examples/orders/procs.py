"""The demo's processes: a broker and the two services, each a real OS process that can be
killed with SIGKILL and started again (the broker on the same store and port)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["ROOT", "Proc", "free_port"]

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """``python -m <args>`` from the repository root; stdout lines are collected (wait for
    one with :meth:`wait_line`), stderr goes to ``log``."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
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
                env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
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

    def wait_line(self, prefix: str, timeout: float = 60.0) -> str:
        """The first stdout line starting with ``prefix``; raises if the process ends or
        ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = f"exited with {self.popen.poll()}" if self._eof else "timed out"
                    raise RuntimeError(
                        f"{self.name} {why} before printing {prefix!r}; see {self.log}"
                    )
                self._cond.wait(left)

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

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL if it does not end in time."""
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(10)
