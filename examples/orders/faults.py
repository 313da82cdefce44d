"""Fault injection for the demo and the acceptance tests.

A service arms a crash point when asked (``POST /faults {"crash": "<point>"}``, or with
``"when": "<value>"`` for the point reached with that value only); the next time the
process reaches that point it prints ``FAULT <point> <detail>`` on stdout and kills itself
with SIGKILL — no cleanup, no flush, as a crash or an OOM kill would.

A hold point (``POST /faults {"hold": "<point>", "when": "<value>"}``) instead stops the
next request that reaches it with that value: it prints ``HOLD <point> <detail>`` and waits
until ``POST /faults {"release": "<point>"}`` (at most a minute) — time for the demo to break
something under it, e.g. to kill the broker set its message is on.
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
    def __init__(self, points: tuple[str, ...], holds: tuple[str, ...] = ()) -> None:
        self.points = points
        self.holds = holds
        self._armed: dict[str, str | None] = {}  # crash point → the value it waits for
        self._holding: dict[str, str] = {}  # hold point → the value it waits for
        self._released: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def arm(self, point: str, when: str | None = None) -> None:
        if point not in self.points:
            raise ValueError(f"unknown crash point {point!r}: one of {', '.join(self.points)}")
        with self._lock:
            self._armed[point] = when

    def armed(self) -> list[str]:
        with self._lock:
            return sorted(self._armed)

    def reached(self, point: str, detail: str, value: str | None = None) -> None:
        """Die here if ``point`` is armed (for ``value``, if it was armed for one)."""
        with self._lock:
            if point not in self._armed or self._armed[point] not in (None, value):
                return
        sys.stdout.write(f"FAULT {point} {detail}\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def hold(self, point: str, when: str) -> None:
        if point not in self.holds:
            raise ValueError(f"unknown hold point {point!r}: one of {', '.join(self.holds)}")
        with self._lock:
            self._holding[point] = when
            self._released[point] = threading.Event()

    def release(self, point: str) -> None:
        with self._lock:
            self._holding.pop(point, None)
            released = self._released.pop(point, None)
        if released is not None:
            released.set()

    def held(self, point: str, value: str, detail: str) -> None:
        """Wait here (the first time only) if ``point`` is held for ``value``."""
        with self._lock:
            if self._holding.get(point) != value:
                return
            del self._holding[point]
            released = self._released[point]
        sys.stdout.write(f"HOLD {point} {detail}\n")
        sys.stdout.flush()
        released.wait(60)

    def route(self, req: Request) -> tuple[int, Any]:
        """``POST /faults`` handler: ``{"crash": point}``, ``{"hold": point, "when":
        value}`` or ``{"release": point}``."""
        body = req.body
        if isinstance(body, dict) and isinstance(body.get("hold"), str):
            self.hold(body["hold"], str(body.get("when", "")))
            return 200, {"holding": body["hold"]}
        if isinstance(body, dict) and isinstance(body.get("release"), str):
            self.release(body["release"])
            return 200, {"released": body["release"]}
        if not isinstance(body, dict) or not isinstance(body.get("crash"), str):
            raise ValueError('expected {"crash": "<point>"}')
        when = body.get("when")
        self.arm(body["crash"], str(when) if when is not None else None)
        return 200, {"armed": self.armed()}
