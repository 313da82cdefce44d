"""What the store found damaged and went on without: corrupt records skipped when read,
bytes skipped by recovery, segments missing or shorter than the checkpoint knew.

Each finding is logged once as a WARNING, counted, and kept (the newest
:data:`KEEP` of them) for ``txmq admin broker-info``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

__all__ = ["KEEP", "Damage", "DamageLedger"]

log = logging.getLogger("txmq.broker.store")

#: findings kept for the admin listing (all of them are counted)
KEEP = 100


@dataclass(frozen=True, slots=True)
class Damage:
    #: "corrupt record" (skipped when read), "skipped at recovery", "missing segment",
    #: "short segment", "commit log short of checkpoint", "commit log cut"
    kind: str
    #: commit-log offset where it starts
    offset: int
    #: bytes it covers (0: unknown)
    size: int
    #: what was found, and where (queue, file)
    detail: str
    #: when it was found (ms since the epoch)
    found_at: int

    def describe(self) -> str:
        size = f", {self.size} bytes" if self.size else ""
        return f"{self.kind} at commit-log offset {self.offset}{size}: {self.detail}"


class DamageLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[tuple[str, int]] = set()
        self.recent: deque[Damage] = deque(maxlen=KEEP)
        self.count = 0
        #: messages known to be gone (consume-queue entries whose records are not in the
        #: commit log any more); other findings cannot count theirs
        self.lost_messages = 0

    def report(self, kind: str, offset: int, size: int, detail: str, *, lost: int = 0) -> bool:
        """Record a finding (once per kind and offset), ``lost`` messages known to be gone
        with it; whether it was new."""
        with self._lock:
            if (kind, offset) in self._seen:
                return False
            if len(self._seen) >= 100_000:  # a ruined disk: log some of it again, stay small
                self._seen.clear()
            self._seen.add((kind, offset))
            damage = Damage(kind, offset, size, detail, time.time_ns() // 1_000_000)
            self.recent.append(damage)
            self.count += 1
            self.lost_messages += lost
        log.warning("store damage: %s", damage.describe())
        return True

    def entries(self) -> list[Damage]:
        with self._lock:
            return list(self.recent)
