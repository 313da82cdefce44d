"""Fault injection for the demo and the acceptance tests.

A service arms a crash point when asked (``POST /faults {"crash": "<point>"}``); the next
time the process reaches that point it prints ``FAULT <point> <detail>`` on stdout and
kills itself with SIGKILL — no cleanup, no flush, as a crash or an OOM kill would.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from examples.orders.web import Request

__all__ = ["Faults"]


class Faults:
    def __init__(self, points: tuple[str, ...]) -> None:
        self.points = points
        self._armed: set[str] = set()
        self._lock = threading.Lock()

    def arm(self, point: str) -> None:
        if point not in self.points:
            raise ValueError(f"unknown crash point {point!r}: one of {', '.join(self.points)}")
        with self._lock:
            self._armed.add(point)

    def armed(self) -> list[str]:
        with self._lock:
            return sorted(self._armed)

    def reached(self, point: str, detail: str) -> None:
        """Die here if ``point`` is armed."""
        with self._lock:
            if point not in self._armed:
                return
        sys.stdout.write(f"FAULT {point} {detail}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def route(self, req: Request) -> tuple[int, Any]:
        """``POST /faults`` handler: ``{"crash": point}``."""
        body = req.body
        if not isinstance(body, dict) or not isinstance(body.get("crash"), str):
            raise ValueError('expected {"crash": "<point>"}')
        self.arm(body["crash"])
        return 200, {"armed": self.armed()}
