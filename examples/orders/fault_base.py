"""What every fault of the demo is made of: its result, its three steps (inject, settled,
verify), and the flow of orders a broker dies under."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from examples.orders.models import CANCELLED, CONFIRMED

if TYPE_CHECKING:
    from examples.orders.demo import Demo

__all__ = ["HOLD", "SETTLED", "Fault", "FaultResult", "Flow", "Placed", "short", "wait_until"]

SETTLED = (CONFIRMED, CANCELLED)
HOLD = "before-broker-commit"


@dataclass
class FaultResult:
    name: str
    what: str
    verified: bool = False
    detail: str = "not verified"
    data: dict[str, Any] = field(default_factory=dict)


class Fault:
    name = ""
    what = ""

    def describe(self, demo: Demo) -> str:
        """What this fault does, in the layout that runs."""
        return self.what

    def inject(self, demo: Demo) -> FaultResult:
        raise NotImplementedError

    def settled(self, demo: Demo, result: FaultResult) -> bool:
        """Whether this fault's own aftermath is over (the demo waits for it, bounded)."""
        return True

    def verify(self, demo: Demo, result: FaultResult) -> None:
        raise NotImplementedError

    def _result(self, **data: Any) -> FaultResult:
        return FaultResult(self.name, self.what, data=data)


def short(order_id: str) -> str:
    return order_id[:8] + "…"


def _error_of(data: Any) -> Any:
    return data.get("error", data) if isinstance(data, dict) else data


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@dataclass(frozen=True)
class Placed:
    began: float
    ended: float
    status: int
    broker: str
    #: why it was refused (the service's error), if it was
    error: str = ""


class Flow:
    """Orders placed without a break by the demo's clients (each pausing ``pause`` s
    between orders) until stopped: the traffic a broker set dies under."""

    def __init__(self, demo: Demo, pause: float = 0.02) -> None:
        self.demo = demo
        self.pause = pause
        self.placed: list[Placed] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        products = sorted(demo.config.stock)
        self._threads = [
            threading.Thread(target=self._client, args=(products[i:] + products[:i],))
            for i in range(demo.config.clients)
        ]

    def _client(self, products: list[str]) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                status, data = self.demo.place(products[n % len(products)], 1)
                n += 1
                broker = str(data.get("broker", "")) if status == 201 else ""
                error = "" if status == 201 else str(_error_of(data))
                with self._lock:
                    self.placed.append(Placed(began, time.monotonic(), status, broker, error))
                time.sleep(self.pause)
        except BaseException as exc:  # surfaces at the next look at the flow, or on exit
            self.errors.append(exc)

    def _check(self) -> None:
        """A client that stopped placing orders (an answer the demo does not expect) ends
        the wait for orders at once, with its error."""
        if self.errors:
            raise RuntimeError(f"a client of the order flow stopped: {self.errors[0]}")

    def since(self, t: float) -> int:
        self._check()
        with self._lock:
            return sum(1 for p in self.placed if p.began > t)

    def accepted_since(self, t: float) -> list[Placed]:
        """The orders placed after ``t`` that were accepted."""
        self._check()
        with self._lock:
            return [p for p in self.placed if p.began > t and p.status == 201]

    def summary(self, t: float) -> str:
        """The orders placed after ``t``: how many were accepted on which broker set, how
        many refused and the last refusal's reason."""
        with self._lock:
            placed = [p for p in self.placed if p.began > t]
        on = Counter(p.broker for p in placed if p.status == 201)
        refused = [p for p in placed if p.status != 201]
        text = f"{len(placed)} orders placed: " + (
            ", ".join(f"{n} accepted on {b}" for b, n in sorted(on.items())) or "none accepted"
        )
        if refused:
            text += f", {len(refused)} refused (the last: {refused[-1].error})"
        return text

    def __enter__(self) -> Flow:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        if self.errors and exc[0] is None:
            raise self.errors[0]
        if self.errors and isinstance(exc[1], BaseException):
            exc[1].add_note(f"a client of the order flow had stopped: {self.errors[0]!r}")
