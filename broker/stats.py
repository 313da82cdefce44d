"""How busy a broker is: messages stored by sends and handed out by pulls, in total and
per second over the last minute (``txmq admin cluster``'s produce and consume rates)."""

from __future__ import annotations

import time
from collections import deque

__all__ = ["Throughput"]


class Throughput:
    """Counters the request services bump, and rates from samples taken as they are read
    (and by :meth:`sample`, which the broker calls every few seconds)."""

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self.put = 0
        self.got = 0
        self._samples: deque[tuple[float, int, int]] = deque()

    def sample(self) -> None:
        now = time.monotonic()
        self._samples.append((now, self.put, self.got))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()

    def rates(self) -> tuple[float, float]:
        """(messages stored per second, messages pulled per second) since the oldest
        sample within the window."""
        self.sample()
        t0, put0, got0 = self._samples[0]
        elapsed = time.monotonic() - t0
        if elapsed <= 0:
            return 0.0, 0.0
        return (self.put - put0) / elapsed, (self.got - got0) / elapsed
