"""The client-side buffer of one queue's pulled, not yet consumed messages."""

from __future__ import annotations

import asyncio
import time

from txmq.protocol.message import MessageExt

__all__ = ["ProcessQueue"]


class ProcessQueue:
    """Messages of one queue between pull and commit (RocketMQ's ProcessQueue).

    Offsets arrive in increasing order, so the dict's first key is the smallest offset
    still in flight: that is the offset a consumer may commit (a slow message holds it back).
    """

    def __init__(self) -> None:
        self.msgs: dict[int, MessageExt] = {}
        self.consuming: dict[int, MessageExt] = {}  # orderly: taken, not yet committed
        self.size = 0
        self.max_offset = -1
        self.dropped = False
        self.locked = False
        self.last_lock_time = 0.0
        self.last_pull_time = time.monotonic()
        self.arrived = asyncio.Event()

    @property
    def count(self) -> int:
        return len(self.msgs) + len(self.consuming)

    @property
    def span(self) -> int:
        first = self.first()
        return 0 if first < 0 else self.max_offset - first

    def first(self) -> int:
        """The smallest offset pulled and not yet consumed (-1: none)."""
        firsts = [next(iter(d)) for d in (self.consuming, self.msgs) if d]
        return min(firsts) if firsts else -1

    def put(self, msgs: list[MessageExt]) -> None:
        for m in msgs:
            if m.queue_offset in self.msgs or m.queue_offset <= self.max_offset:
                continue
            self.msgs[m.queue_offset] = m
            self.size += len(m.body)
            self.max_offset = m.queue_offset
        self.arrived.set()

    def remove(self, msg: MessageExt) -> int:
        """Forget a consumed message; the offset to commit (-1: nothing consumed yet)."""
        m = self.msgs.pop(msg.queue_offset, None)
        if m is not None:
            self.size -= len(m.body)
        return self.commit_offset()

    def commit_offset(self) -> int:
        first = self.first()
        if first >= 0:
            return first
        return self.max_offset + 1 if self.max_offset >= 0 else -1

    # -- orderly ---------------------------------------------------------------------------

    def take(self) -> MessageExt | None:
        """The next message in queue order (orderly consumption), or None."""
        if not self.msgs:
            self.arrived.clear()
            return None
        offset = next(iter(self.msgs))
        m = self.msgs.pop(offset)
        self.consuming[offset] = m
        return m

    def commit_taken(self) -> int:
        for m in self.consuming.values():
            self.size -= len(m.body)
        self.consuming.clear()
        return self.commit_offset()

    def give_back(self) -> None:
        """Put taken messages back in front (a failed orderly attempt)."""
        if self.consuming:
            self.msgs = {**self.consuming, **self.msgs}
            self.consuming.clear()

    def lock_expired(self, max_live: float) -> bool:
        return time.monotonic() - self.last_lock_time > max_live
