"""What the broker's services share: a narrow context instead of the whole broker.

Each service (sending, pulling, groups, locks, retries, transactions, the schedule, the
admin queries) is built from a :class:`BrokerContext`: the store, the topic and offset
tables, the group registries, and two pieces every writer needs — :class:`Arrivals` (wake
long-polling pulls when a queue gets a message) and :class:`FlushAcks` (under SYNC flush,
answer a write only once it is on disk).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TypeVar

import anyio

from txmq.broker.config import BrokerConfig
from txmq.broker.consumers import ConsumerManager, ProducerManager
from txmq.broker.locks import RebalanceLockManager
from txmq.broker.offsets import ConsumerOffsetManager
from txmq.broker.stats import Throughput
from txmq.broker.store import MessageStore
from txmq.broker.topics import TopicManager
from txmq.errors import FlushDiskTimeout

__all__ = ["Arrivals", "BrokerContext", "FlushAcks"]

T = TypeVar("T")


class Arrivals:
    """Long polling's wake-ups: an event per queue that somebody waits on."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, int], anyio.Event] = {}

    def notify(self, topic: str, queue_id: int) -> None:
        """A message arrived in ``topic``/``queue_id``: wake whoever waits for it."""
        event = self._events.pop((topic, queue_id), None)
        if event is not None:
            event.set()

    def event(self, topic: str, queue_id: int) -> anyio.Event:
        """An event set by the next :meth:`notify` of this queue.  Take it in the same step
        as the read that found nothing (no ``await`` in between), or a message stored in
        the gap wakes nobody."""
        key = (topic, queue_id)
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = anyio.Event()
        return event

    def waiting(self, topic: str, queue_id: int) -> bool:
        """Whether a pull waits for this queue now."""
        return (topic, queue_id) in self._events


class FlushAcks:
    """Answers to writes: at once under ASYNC flush; under SYNC flush once the store has
    fsynced past the write (group commit), or :class:`FlushDiskTimeout`."""

    def __init__(self, store: MessageStore, config: BrokerConfig) -> None:
        self.store = store
        self.sync = config.flush.value == "sync"
        self.timeout_s = config.sync_flush_timeout_s

    def after_flush(self, end_offset: int, answer: T) -> T | asyncio.Future[T]:
        """``answer`` now, or a future of it that resolves when ``end_offset`` is on disk."""
        if not self.sync:
            return answer
        flushed = self.store.flush_future(end_offset)
        if flushed is None:
            return answer
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()
        limit = self.timeout_s

        def on_flushed(f: asyncio.Future[None]) -> None:
            expiry.cancel()
            if result.done():
                return
            if f.cancelled() or f.exception() is not None:
                result.set_exception(FlushDiskTimeout(f"flush failed: {f.exception()}"))
            else:
                result.set_result(answer)

        def on_timeout() -> None:
            if not result.done():
                result.set_exception(
                    FlushDiskTimeout(f"message stored but not flushed within {limit}s")
                )

        expiry = loop.call_later(limit, on_timeout)
        flushed.add_done_callback(on_flushed)
        return result


@dataclass(slots=True)
class BrokerContext:
    """The broker's shared state, given to each service."""

    config: BrokerConfig
    store: MessageStore
    topics: TopicManager
    offsets: ConsumerOffsetManager
    consumers: ConsumerManager
    producers: ProducerManager
    locks: RebalanceLockManager
    arrivals: Arrivals
    acks: FlushAcks
    throughput: Throughput = field(default_factory=Throughput)
