"""What the broker's services share: a narrow context instead of the whole broker.

Each service (sending, pulling, groups, locks, retries, transactions, the schedule, the
admin queries) is built from a :class:`BrokerContext`: the store, the topic and offset
tables, the group registries, and two pieces every writer needs — :class:`Arrivals` (wake
long-polling pulls when a queue gets a message) and :class:`FlushAcks` (under SYNC flush,
answer a write only once it is on disk).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import anyio
import msgspec

from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.dedupe import DedupeWindow
from txmq.broker.state.groups import ConsumerManager, ProducerManager
from txmq.broker.state.locks import RebalanceLockManager
from txmq.broker.state.offsets import ConsumerOffsetManager
from txmq.broker.state.stats import Throughput
from txmq.broker.state.subscriptions import SubscriptionGroupManager
from txmq.broker.state.topics import TopicManager
from txmq.broker.store import MessageStore
from txmq.protocol.wire.errors import (
    FlushDiskTimeout,
    FlushSlaveTimeout,
    NotMaster,
    SlaveNotAvailable,
    TxmqError,
)

if TYPE_CHECKING:
    from txmq.security.acl.guard import Guard

__all__ = [
    "Arrivals",
    "BrokerContext",
    "Clock",
    "FlushAcks",
    "ReplicaView",
    "ReplicationGate",
]

T = TypeVar("T")


class Clock:
    """The wall clock due times are read from (delay levels, timer messages): the system's
    own, which a test may move forward (:meth:`advance`) to have what is due delivered
    without waiting; whoever waits for a due time is woken then."""

    def __init__(self) -> None:
        self.skew_ms = 0
        #: run when the clock moves forward (the waits for due times)
        self.on_advance: list[Callable[[], None]] = []

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.skew_ms

    def advance(self, seconds: float) -> None:
        """Move this clock ``seconds`` forward (never back)."""
        if not seconds >= 0:
            raise ValueError("the clock moves forward only")
        self.skew_ms += round(seconds * 1000)
        for wake in self.on_advance:
            wake()


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

    def may_acknowledge(self) -> bool: ...
    def sync_replication(self) -> bool: ...
    def when_copied(
        self, end_offset: int, done: Callable[[str], None], timeout_s: float
    ) -> str | None: ...


class FlushAcks:
    """Answers to writes.  At once under ASYNC flush and without replication; under SYNC
    flush once the store has fsynced past the write (group commit), or
    :class:`FlushDiskTimeout`; as a SYNC_MASTER also once a slave has the bytes (group
    transfer) — the write is stored either way, and the answer says
    ``FLUSH_SLAVE_TIMEOUT`` / ``SLAVE_NOT_AVAILABLE`` when no slave confirmed.  A broker
    that is no longer the master (or, under a controller, whose lease ran out) answers
    :class:`NotMaster` instead of acknowledging."""

    def __init__(
        self, store: MessageStore, config: BrokerConfig, gate: ReplicationGate | None = None
    ) -> None:
        """``gate``: replication's say in the answers (None: a broker without replication,
        as in the tests of the store and the services)."""
        self.store = store
        self.sync = config.flush.value == "sync"
        self.timeout_s = config.sync_flush_timeout_s
        self.replication_timeout_s = config.sync_replication_timeout_s
        self.gate = gate

    def after_flush(self, end_offset: int, answer: T) -> T | asyncio.Future[T]:
        """``answer`` now, or a future of it that resolves when ``end_offset`` is on disk
        (SYNC flush) and on a slave (SYNC_MASTER)."""
        flushed = self.store.flush_future(end_offset) if self.sync else None
        gate = self.gate
        if gate is None or not gate.sync_replication():
            if flushed is None:
                return self._final(answer, "")
            return _Ack(self, answer, flushed, copying=False).result
        ack = _Ack(self, answer, flushed, copying=True)
        status = gate.when_copied(end_offset, ack.copied, self.replication_timeout_s)
        if status is not None:  # copied already, or no slave to copy it
            if flushed is None:
                return self._final(answer, status)
            ack.copied(status)
        return ack.result

    def check_may_store(self) -> None:
        """A write that could not be acknowledged is refused before it is stored: a master
        whose controller lease ran out (paused, or cut off from its controller and slaves)
        answers NOT_MASTER at once rather than store, wait for a slave and then refuse
        (the client would wait sync_replication_timeout_s for nothing)."""
        gate = self.gate
        if gate is not None and self.store.writable and not gate.may_acknowledge():
            raise NotMaster(
                "this broker is no longer sure it is the master (deposed, or its controller "
                "lease ran out): not stored; send again to the master"
            )

    def _final(self, answer: T, missing: str) -> T:
        gate = self.gate
        if gate is not None and not gate.may_acknowledge():
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


class _Ack(Generic[T]):
    """One write's answer that waits: for the flush (SYNC flush, with its own time-out)
    and/or a slave's copy (SYNC_MASTER, timed by the HA service)."""

    __slots__ = ("_acks", "_answer", "_copy", "_flush", "_timer", "result")

    def __init__(
        self, acks: FlushAcks, answer: T, flushed: asyncio.Future[None] | None, *, copying: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        self._acks = acks
        self._answer = answer
        self.result: asyncio.Future[T] = loop.create_future()
        #: the copy's outcome (None: waiting; "" copied; else the status to answer)
        self._copy: str | None = None if copying else ""
        self._flush = flushed
        self._timer: asyncio.TimerHandle | None = None
        if flushed is not None:
            self._timer = loop.call_later(acks.timeout_s, self._flush_late)
            flushed.add_done_callback(lambda _: self._settle())

    def copied(self, status: str) -> None:
        self._copy = status
        self._settle()

    def _flush_late(self) -> None:
        if not self.result.done():
            self.result.set_exception(
                FlushDiskTimeout(f"message stored but not flushed within {self._acks.timeout_s}s")
            )

    def _settle(self) -> None:
        result, flushed = self.result, self._flush
        if result.done() or self._copy is None or (flushed is not None and not flushed.done()):
            return
        if self._timer is not None:
            self._timer.cancel()
        if flushed is not None and (flushed.cancelled() or flushed.exception()):
            why = "cancelled" if flushed.cancelled() else flushed.exception()
            result.set_exception(FlushDiskTimeout(f"flush failed: {why}"))
            return
        try:
            result.set_result(self._acks._final(self._answer, self._copy))
        except TxmqError as exc:
            result.set_exception(exc)


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
    groups: SubscriptionGroupManager = field(default_factory=SubscriptionGroupManager.in_memory)
    #: the ids of the messages clients stored recently (None: ``dedupe_window_s = 0``)
    dedupe: DedupeWindow | None = None
    #: access control (``acl_file``; None: off)
    guard: Guard | None = None
    #: the wall clock of due times
    clock: Clock = field(default_factory=Clock)
