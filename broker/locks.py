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
from typing import TYPE_CHECKING, Any

from txmq.errors import BadRequest, ResponseCode
from txmq.protocol import Frame, RequestCode
from txmq.remoting import Connection, HandlerResult, Response

if TYPE_CHECKING:
    from txmq.broker.server import Broker

__all__ = ["LockEntry", "QueueLockHandlers", "RebalanceLockManager", "parse_queues"]

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


def parse_queues(raw: object) -> list[Queue]:
    """``[[topic, queue_id], ...]`` from a request header."""
    if not isinstance(raw, list):
        raise BadRequest("request header field 'queues' must be a list of [topic, queue_id]")
    out: list[Queue] = []
    for item in raw:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], int)
            or isinstance(item[1], bool)
        ):
            raise BadRequest(f"queue {item!r} is not a [topic, queue_id] pair")
        out.append((item[0], item[1]))
    return out


def _str_field(header: dict[str, Any], name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"request header field {name!r} must be a non-empty string")
    return value


class QueueLockHandlers:
    """LOCK_BATCH_MQ and UNLOCK_BATCH_MQ."""

    def __init__(self, broker: Broker) -> None:
        self.locks: RebalanceLockManager = broker.locks

    def handlers(self) -> dict[int, Callable[[Connection, Frame], HandlerResult]]:
        return {
            RequestCode.LOCK_BATCH_MQ: self.lock_batch,
            RequestCode.UNLOCK_BATCH_MQ: self.unlock_batch,
        }

    def lock_batch(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        locked = self.locks.try_lock_batch(
            _str_field(h, "group"), parse_queues(h.get("queues")), _str_field(h, "client_id")
        )
        return (ResponseCode.SUCCESS, {"locked": [[t, q] for t, q in locked]}, b"")

    def unlock_batch(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        self.locks.unlock_batch(
            _str_field(h, "group"), parse_queues(h.get("queues")), _str_field(h, "client_id")
        )
        return (ResponseCode.SUCCESS, None, b"")
