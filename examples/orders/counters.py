"""Event counters a service shows on ``GET /stats``, safe to bump from any thread."""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["Counters"]


class Counters:
    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
