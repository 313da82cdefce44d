"""Queue locks for orderly consumption (RocketMQ's ``RebalanceLockManager``).

A consumer that consumes a queue in order first locks it on the broker and renews the lock
every 20 s; a lock not renewed for ``lock_expiry_s`` (60 s) may be taken by another member
of the group.  Locks live in memory only: after a broker restart every lock is free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from txmq.protocol.rpc import Call
from txmq.protocol.wire import Empty, LockBatchMq, Locked, UnlockBatchMq

__all__ = ["LockEntry", "LockService", "RebalanceLockManager"]

Queue = tuple[str, int]


@dataclass(slots=True)
class LockEntry:
    client_id: str
    last_update: float


class RebalanceLockManager:
    """Locks by consumer group and (topic, queue id); ``clock`` is ``time.monotonic``."""

    def __init__(self, expiry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.expiry_s = expiry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._groups: dict[str, dict[Queue, LockEntry]] = {}

    def _expired(self, entry: LockEntry, now: float) -> bool:
        return now - entry.last_update > self.expiry_s

    def try_lock_batch(self, group: str, queues: Iterable[Queue], client_id: str) -> list[Queue]:
        """Lock (or renew) what is free, expired or already ours; return what we now hold."""
        now = self._clock()
        locked: list[Queue] = []
        with self._lock:
            table = self._groups.setdefault(group, {})
            for mq in dict.fromkeys(queues):
                entry = table.get(mq)
                if entry is None or entry.client_id == client_id or self._expired(entry, now):
                    table[mq] = LockEntry(client_id, now)
                    locked.append(mq)
        return locked

    def unlock_batch(self, group: str, queues: Iterable[Queue], client_id: str) -> int:
        """Release the caller's locks among ``queues``; return how many were released."""
        released = 0
        with self._lock:
            table = self._groups.get(group)
            if not table:
                return 0
            for mq in queues:
                entry = table.get(mq)
                if entry is not None and entry.client_id == client_id:
                    del table[mq]
                    released += 1
            if not table:
                del self._groups[group]
        return released

    def is_locked(self, group: str, mq: Queue, client_id: str) -> bool:
        """Whether ``client_id`` holds an unexpired lock on ``mq``."""
        entry = self._groups.get(group, {}).get(mq)
        return (
            entry is not None
            and entry.client_id == client_id
            and not self._expired(entry, self._clock())
        )

    def owner(self, group: str, mq: Queue) -> str | None:
        """The client holding an unexpired lock on ``mq``, if any."""
        entry = self._groups.get(group, {}).get(mq)
        if entry is None or self._expired(entry, self._clock()):
            return None
        return entry.client_id


class LockService:
    """LOCK_BATCH_MQ and UNLOCK_BATCH_MQ."""

    def __init__(self, locks: RebalanceLockManager) -> None:
        self.locks = locks

    def lock_batch(self, req: LockBatchMq, call: Call) -> Locked:
        locked = self.locks.try_lock_batch(req.group, req.queues, req.client_id)
        return Locked(locked=locked)

    def unlock_batch(self, req: UnlockBatchMq, call: Call) -> Empty:
        self.locks.unlock_batch(req.group, req.queues, req.client_id)
        return Empty()
