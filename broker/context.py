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
from typing import Protocol, TypeVar

import anyio
import msgspec

from txmq.broker.config import BrokerConfig
from txmq.broker.consumers import ConsumerManager, ProducerManager
from txmq.broker.locks import RebalanceLockManager
from txmq.broker.offsets import ConsumerOffsetManager
from txmq.broker.stats import Throughput
from txmq.broker.store import MessageStore
from txmq.broker.topics import TopicManager
from txmq.errors import (
    FlushDiskTimeout,
    FlushSlaveTimeout,
    NotMaster,
    SlaveNotAvailable,
    TxmqError,
)

__all__ = ["Arrivals", "BrokerContext", "FlushAcks", "ReplicaView", "ReplicationGate"]

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


class ReplicaView(Protocol):
    """What the pulls need from replication: whether this broker is its set's master, and
    where a reader that many bytes behind the log's end should pull next (0: the master,
    1: a slave)."""

    def is_master(self) -> bool: ...
    def read_from(self, behind: int) -> int: ...


class _Alone:
    """A broker without replication: the master, read from it."""

    def is_master(self) -> bool:
        return True

    def read_from(self, behind: int) -> int:
        return 0


class ReplicationGate(Protocol):
    """What the acknowledgements need from replication (``broker/ha``)."""

    def may_acknowledge(self, confirmed: bool = False) -> bool: ...
    def sync_replication(self) -> bool: ...
    def replicated_future(self, end_offset: int) -> asyncio.Future[None] | None: ...


class FlushAcks:
    """Answers to writes.  At once under ASYNC flush and without replication; under SYNC
    flush once the store has fsynced past the write (group commit), or
    :class:`FlushDiskTimeout`; as a SYNC_MASTER also once a slave has the bytes (group
    transfer) — the write is stored either way, and the answer says
    ``FLUSH_SLAVE_TIMEOUT`` / ``SLAVE_NOT_AVAILABLE`` when no slave confirmed.  A broker
    that is no longer the master (or, under a controller, whose lease ran out) answers
    :class:`NotMaster` instead of acknowledging."""

    def __init__(self, store: MessageStore, config: BrokerConfig) -> None:
        self.store = store
        self.sync = config.flush.value == "sync"
        self.timeout_s = config.sync_flush_timeout_s
        self.replication_timeout_s = config.sync_replication_timeout_s
        #: set by the broker when it belongs to a replicated broker set
        self.gate: ReplicationGate | None = None

    def after_flush(self, end_offset: int, answer: T) -> T | asyncio.Future[T]:
        """``answer`` now, or a future of it that resolves when ``end_offset`` is on disk
        (SYNC flush) and on a slave (SYNC_MASTER)."""
        flushed = self.store.flush_future(end_offset) if self.sync else None
        gate = self.gate
        copied: asyncio.Future[None] | None = None
        missing = ""
        #: whether a slave's confirmation is what acknowledges this write (SYNC_MASTER)
        replicated = gate is not None and gate.sync_replication()
        if gate is not None and replicated:
            try:
                copied = gate.replicated_future(end_offset)
            except LookupError:
                missing = "SLAVE_NOT_AVAILABLE"
        if flushed is None and copied is None:
            return self._final(answer, missing, replicated)
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()
        waits = [f for f in (flushed, copied) if f is not None]
        timers: list[asyncio.TimerHandle] = []

        def settle() -> None:
            if result.done() or any(not f.done() for f in waits):
                return
            for t in timers:
                t.cancel()
            if flushed is not None and (flushed.cancelled() or flushed.exception()):
                why = "cancelled" if flushed.cancelled() else flushed.exception()
                result.set_exception(FlushDiskTimeout(f"flush failed: {why}"))
                return
            if copied is not None and (copied.cancelled() or copied.exception()):
                exc = copied.exception() if not copied.cancelled() else None
                result.set_exception(exc or NotMaster("the write's replication was cancelled"))
                return
            try:
                result.set_result(self._final(answer, missing, replicated))
            except TxmqError as exc:
                result.set_exception(exc)

        def flush_late() -> None:
            if not result.done():
                result.set_exception(
                    FlushDiskTimeout(f"message stored but not flushed within {self.timeout_s}s")
                )

        def slave_late() -> None:
            nonlocal missing
            if copied is not None and not copied.done():
                missing = "FLUSH_SLAVE_TIMEOUT"
                copied.set_result(None)  # stored, not copied: answered with that status

        if flushed is not None:
            timers.append(loop.call_later(self.timeout_s, flush_late))
            flushed.add_done_callback(lambda _: settle())
        if copied is not None:
            timers.append(loop.call_later(self.replication_timeout_s, slave_late))
            copied.add_done_callback(lambda _: settle())
        return result

    def _final(self, answer: T, missing: str, replicated: bool = False) -> T:
        gate = self.gate
        if gate is not None and not gate.may_acknowledge(replicated and not missing):
            raise NotMaster(
                "stored, but this broker is no longer sure it is the master (deposed, or its "
                "controller lease ran out): not acknowledged; send again to the master"
            )
        if not missing:
            return answer
        if isinstance(answer, msgspec.Struct) and hasattr(answer, "status"):
            replaced: T = msgspec.structs.replace(answer, status=missing)
            return replaced
        if missing == "SLAVE_NOT_AVAILABLE":
            raise SlaveNotAvailable("stored on the master, but no slave is connected to copy it")
        raise FlushSlaveTimeout(
            f"stored on the master, but no slave confirmed a copy within "
            f"{self.replication_timeout_s}s"
        )


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
    replica: ReplicaView = field(default_factory=_Alone)
