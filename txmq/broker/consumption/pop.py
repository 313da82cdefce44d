"""RocketMQ 5's *pop* consumption on txmq's queues and offsets (the gRPC endpoint's
ReceiveMessage / AckMessage / ChangeInvisibleDuration / ForwardMessageToDeadLetterQueue).

A pop takes messages of a topic (its queues on this broker, plus ``%RETRY%<group>``) and
hands each out with a *receipt handle*, invisible for ``invisible_ms``; the consumer acks
it, or changes its invisible time (how the official PushConsumer nacks with its back-off).
Per (group, queue) the service keeps ``next`` (never popped yet) and the in-flight
messages; the group's committed offset in ``ctx.offsets`` (the table pull consumers use) is
the smallest offset in flight, else ``next``, committed whenever it changes.  A group new to
a queue starts at its min offset when that is 0 (nothing lost to retention), else at its
max offset (RocketMQ's init), committed at once.

An expired message is copied to ``%RETRY%<group>`` (visible at once: the invisible time
was the back-off; reconsume times = the attempt that expired) and the original is done; once
``max_attempts`` are used up the copy goes to ``%DLQ%<group>``.  FIFO pops hand out one
batch per queue at a time (nothing more from a queue until all of its batch is acked); an
expired FIFO message is redelivered in place (same offset, attempt + 1, new handle), or
dead-lettered once its attempts are used up.

``%RETRY%<group>`` is shared by a group's topics: a pop of topic T takes from it only the
messages whose RETRY_TOPIC is T (or unset), each topic with its own cursor; the queue's
committed offset is the smallest of theirs (and of messages seen for a topic not popped yet).

A receipt handle names this service instance (a random epoch), the delivery (a token),
the queue, queue offset and commit-log offset.  A handle of an acked or redelivered message,
one replaced by :meth:`PopService.change_invisible`, another group's, or one of an earlier
broker run raises :class:`InvalidReceiptHandle`.  The in-flight state lives in memory only:
after a restart old handles are refused and whatever is past the committed offset is
delivered again (at least once, like pulls).

On a slave (``ctx.replica.is_master()`` false) pops and acks work (offsets are kept to be
handed back to the master, as pulls do) but nothing is written: an expired message is
redelivered in place (even past ``max_attempts``) and :meth:`PopService.dead_letter` raises
:class:`NotMaster`.  A copy the store refuses (disk full...) is logged and the message
redelivered in place.  Copies do not wait for SYNC flush.  All runs on the event loop.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass, field

import anyio
import anyio.abc

from txmq.broker.consumption.retry import ON_PURPOSE, RetryService
from txmq.broker.state.context import BrokerContext
from txmq.broker.store import GetStatus
from txmq.protocol.codec import decode_record
from txmq.protocol.message import MessageExt, Prop, retry_topic
from txmq.protocol.wire.errors import (
    BadRequest,
    InvalidReceiptHandle,
    MessageNotFound,
    NotMaster,
    TopicNotFound,
    TxmqError,
)

__all__ = ["MAX_INVISIBLE_MS", "MAX_POLL_MS", "MAX_POP_BATCH", "PopService", "Popped"]

log = logging.getLogger("txmq.broker.pop")

MAX_POP_BATCH = 32
MAX_INVISIBLE_MS = 12 * 3600 * 1000
MAX_POLL_MS = 30_000
MAX_ATTEMPTS = 1000
_SWEEP_S = 1.0
#: epoch : token : queue id : queue offset : commit-log offset : stored topic
_HANDLE = re.compile(
    r"([0-9a-f]{8}):([0-9a-f]{1,16}):(\d{1,5}):(\d{1,19}):(\d{1,19}):(\S{1,255})", re.A
)

QueueKey = tuple[str, str, int]  # (group, stored topic, queue id)


@dataclass(slots=True, frozen=True)
class Popped:
    msg: MessageExt  # as stored (msg.topic may be %RETRY%<group>)
    handle: str  # receipt handle (opaque ASCII)
    attempt: int  # delivery attempt, 1-based
    invisible_until_ms: int  # wall-clock ms when it becomes visible again


@dataclass(slots=True)
class _Entry:
    token: int
    attempt: int
    phy: int  # commit-log offset
    max_attempts: int
    fifo: bool
    due: float | None  # monotonic deadline; None: visible again, to be redelivered in place


@dataclass(slots=True, frozen=True)
class _How:
    """How a pop hands messages out."""

    invisible_ms: int
    max_attempts: int
    fifo: bool


@dataclass(slots=True)
class _Cursor:
    next: int
    #: queue offset -> entry, inserted in increasing offset order (the first is the lowest)
    inflight: dict[int, _Entry] = field(default_factory=dict)
    ready: int = 0  # entries visible again (due None)

    def low(self) -> int:
        return next(iter(self.inflight), self.next)


@dataclass(slots=True)
class _Queue:
    committed: int
    cursors: dict[str, _Cursor] = field(default_factory=dict)  # popped topic -> cursor
    #: retry queue: a topic without a cursor yet -> its first message seen by another's
    orphans: dict[str, int] = field(default_factory=dict)

    def low(self) -> int:
        lows = [c.low() for c in self.cursors.values()] + list(self.orphans.values())
        return min(lows, default=self.committed)


def _check(name: str, value: object, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer in {lo}..{hi}, not {value!r}")
    return value


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def _wait_any(events: list[anyio.Event], timeout: float) -> None:
    """Until one of ``events`` is set, or ``timeout`` seconds."""
    if any(e.is_set() for e in events):
        return
    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as tg:

            async def wait(event: anyio.Event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            for event in events:
                tg.start_soon(wait, event)


class PopService:
    """Pop, ack, change the invisible time, dead-letter; :meth:`run` expires messages."""

    def __init__(self, ctx: BrokerContext, retry: RetryService) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.retry = retry
        self._epoch = os.urandom(4).hex()
        self._tokens = itertools.count(1)
        self._queues: dict[QueueKey, _Queue] = {}
        self._rotor: dict[tuple[str, str], int] = {}
        #: (due, token, key, popped topic, queue offset); stale ones are skipped
        self._due: list[tuple[float, int, QueueKey, str, int]] = []
        self._live = 0  # entries in flight
        self._visible: dict[str, anyio.Event] = {}  # group -> wakes its long-polling pops
        self._run_wake: anyio.Event | None = None
        self._run_until = 0.0

    # -- pop --------------------------------------------------------------------------------

    async def pop(
        self,
        *,
        group: str,
        topic: str,
        max_msgs: int,
        invisible_ms: int,
        poll_ms: int,
        tag_codes: set[int] | None,
        fifo: bool,
        max_attempts: int,
    ) -> list[Popped]:
        """Up to ``max_msgs`` messages, each invisible for ``invisible_ms``; with none at
        hand, wait up to ``poll_ms`` for one (``[]`` then)."""
        if not isinstance(group, str) or not group:
            raise BadRequest("group must be a non-empty string")
        _check("max_msgs", max_msgs, 1, MAX_POP_BATCH)
        _check("invisible_ms", invisible_ms, 1, MAX_INVISIBLE_MS)
        _check("poll_ms", poll_ms, 0, MAX_POLL_MS)
        _check("max_attempts", max_attempts, 1, MAX_ATTEMPTS)
        deadline = time.monotonic() + poll_ms / 1000
        retry = retry_topic(group)
        while True:
            self._expire_due(time.monotonic())
            sources = self._sources(group, topic)
            out = self._collect(
                group, topic, sources, max_msgs, invisible_ms, tag_codes, fifo, max_attempts
            )
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                tally = self.ctx.throughput.tally
                if tally is not None and out:
                    tally.popped(
                        group, topic, [(len(p.msg.body), p.msg.store_timestamp) for p in out]
                    )
                return out
            # taken in the same step as the empty reads: nothing stored meanwhile is missed
            events = [self.ctx.arrivals.event(t, q) for t, q in sources]
            if (retry, 0) not in sources:  # created by an expiry while we wait
                events.append(self.ctx.arrivals.event(retry, 0))
            events.append(self._visible_event(group))
            await _wait_any(events, remaining)

    def _sources(self, group: str, topic: str) -> list[tuple[str, int]]:
        cfg = self.ctx.topics.get(topic)
        if cfg is None:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        sources = [(topic, q) for q in range(cfg.queue_nums)]
        retry = retry_topic(group)
        if retry != topic and self.ctx.topics.get(retry) is not None:
            sources.append((retry, 0))
        return sources

    def _collect(
        self,
        group: str,
        topic: str,
        sources: list[tuple[str, int]],
        max_msgs: int,
        invisible_ms: int,
        tag_codes: set[int] | None,
        fifo: bool,
        max_attempts: int,
    ) -> list[Popped]:
        n = len(sources)
        start = self._rotor.get((group, topic), 0) % n
        self._rotor[(group, topic)] = start + 1
        out: list[Popped] = []
        how = _How(invisible_ms, max_attempts, fifo)
        for i in range(n):
            room = max_msgs - len(out)
            if room <= 0:
                break
            stored, qid = sources[(start + i) % n]
            key = (group, stored, qid)
            q = self._queue(key)
            c = self._cursor(q, topic)
            if c.ready and (not fifo or c.ready == len(c.inflight)):
                out.extend(self._redeliver(q, key, topic, c, how, room))
                continue
            if fifo and c.inflight:
                continue  # one batch at a time: wait until all of it is acked
            got = self.store.get_messages(stored, qid, c.next, room, tag_codes=tag_codes)
            for record in got.records:
                msg = decode_record(record)
                origin = msg.all_properties.get(Prop.RETRY_TOPIC)
                if stored != topic and origin and origin != topic:
                    if origin not in q.cursors:  # its topic's pops take it later
                        q.orphans.setdefault(origin, msg.queue_offset)
                    continue
                out.append(self._deliver(key, topic, c, how, msg, msg.reconsume_times + 1))
            if got.status in (
                GetStatus.FOUND,
                GetStatus.NO_MATCHED_MESSAGE,
                GetStatus.OFFSET_FOUND_NULL,
                GetStatus.OFFSET_TOO_SMALL,
            ):  # what was skipped (tags, holes, retention) counts as consumed
                c.next = max(c.next, got.next_begin_offset)
            elif got.status is GetStatus.OFFSET_OVERFLOW_BADLY and not c.inflight:
                c.next = got.next_begin_offset
            self._settle(key, q)
        return out

    def _redeliver(
        self, q: _Queue, key: QueueKey, topic: str, c: _Cursor, how: _How, room: int
    ) -> list[Popped]:
        """In place, in offset order: the entries visible again."""
        out: list[Popped] = []
        for offset, e in list(c.inflight.items()):
            if len(out) >= room:
                break
            if e.due is not None:
                continue
            record = self.store.look_message_by_offset(e.phy)
            if record is None:  # removed by retention meanwhile
                self._done(key, q, c, offset, e)
                continue
            c.ready -= 1
            out.append(self._deliver(key, topic, c, how, decode_record(record), e.attempt + 1))
        return out

    def _deliver(
        self, key: QueueKey, topic: str, c: _Cursor, how: _How, msg: MessageExt, attempt: int
    ) -> Popped:
        """Hand ``msg`` out of cursor ``c``: a new token, deadline and handle."""
        token = next(self._tokens)
        due = time.monotonic() + how.invisible_ms / 1000
        offset, phy = msg.queue_offset, msg.commit_log_offset
        e = c.inflight.get(offset)
        if e is None:
            e = c.inflight[offset] = _Entry(token, attempt, phy, how.max_attempts, how.fifo, due)
            self._live += 1
        else:
            e.token, e.attempt, e.due = token, attempt, due
            e.max_attempts, e.fifo = how.max_attempts, how.fifo
        heapq.heappush(self._due, (due, token, key, topic, offset))
        if self._run_wake is not None and due < self._run_until:
            self._run_wake.set()
        handle = f"{self._epoch}:{token:x}:{key[2]}:{offset}:{phy}:{key[1]}"
        return Popped(msg, handle, attempt, _now_ms() + how.invisible_ms)

    def inflight(self) -> dict[tuple[str, str], int]:
        """(group, topic) -> messages popped and neither acked nor visible again yet."""
        out: dict[tuple[str, str], int] = {}
        for (group, _, _), q in self._queues.items():
            for topic, c in q.cursors.items():
                if c.inflight:
                    out[(group, topic)] = out.get((group, topic), 0) + len(c.inflight) - c.ready
        return out

    # -- queue state and offsets ------------------------------------------------------------

    def _queue(self, key: QueueKey) -> _Queue:
        group, topic, qid = key
        q = self._queues.get(key)
        stored = self.ctx.offsets.query(group, topic, qid)
        if q is None:
            if stored < 0:
                stored = (
                    0
                    if self.store.min_offset(topic, qid) == 0
                    else self.store.max_offset(topic, qid)
                )
                self._commit(key, stored)
            q = self._queues[key] = _Queue(stored)
        elif stored >= 0 and stored != q.committed and not self._busy(q):
            # reset from outside (an operator, or a master's offsets taken by a slave)
            q.committed = stored
            q.orphans.clear()
            for c in q.cursors.values():
                c.next = stored
        return q

    @staticmethod
    def _busy(q: _Queue) -> bool:
        return any(c.inflight for c in q.cursors.values())

    @staticmethod
    def _cursor(q: _Queue, topic: str) -> _Cursor:
        c = q.cursors.get(topic)
        if c is None:
            c = q.cursors[topic] = _Cursor(q.low())
            q.orphans.pop(topic, None)
        return c

    def _settle(self, key: QueueKey, q: _Queue) -> None:
        low = q.low()
        if low != q.committed:
            q.committed = low
            self._commit(key, low)

    def _commit(self, key: QueueKey, offset: int) -> None:
        group, topic, qid = key
        hand_back = not self.ctx.replica.is_master()
        self.ctx.offsets.commit(group, topic, qid, offset, hand_back=hand_back)

    def _done(self, key: QueueKey, q: _Queue, c: _Cursor, offset: int, e: _Entry) -> None:
        del c.inflight[offset]
        self._live -= 1
        if e.due is None:
            c.ready -= 1
        self._settle(key, q)
        if e.fifo and not c.inflight:
            self._wake(key[0])  # the queue's next batch may go

    def _visible_event(self, group: str) -> anyio.Event:
        event = self._visible.get(group)
        if event is None:
            event = self._visible[group] = anyio.Event()
        return event

    def _wake(self, group: str) -> None:
        event = self._visible.pop(group, None)
        if event is not None:
            event.set()

    # -- receipt handles --------------------------------------------------------------------

    def _find(
        self, group: str, topic: str, handle: str
    ) -> tuple[QueueKey, _Queue, _Cursor, int, _Entry]:
        if self.ctx.topics.get(topic) is None:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        m = _HANDLE.fullmatch(handle) if isinstance(handle, str) else None
        if m is None:
            raise InvalidReceiptHandle("malformed receipt handle")
        epoch, token_s, qid_s, offset_s, phy_s, stored = m.groups()
        if epoch != self._epoch:
            raise InvalidReceiptHandle(
                "receipt handle of another broker or of an earlier run of this one (in-flight "
                "messages are not kept across restarts: the message will be delivered again)"
            )
        if stored not in (topic, retry_topic(group)):
            raise InvalidReceiptHandle(f"receipt handle of topic {stored!r}, not {topic!r}")
        key = (group, stored, int(qid_s))
        offset = int(offset_s)
        q = self._queues.get(key)
        c = q.cursors.get(topic) if q is not None else None
        e = c.inflight.get(offset) if c is not None else None
        if q is None or c is None or e is None:
            raise InvalidReceiptHandle(
                "receipt handle expired: the message is no longer in flight for this group "
                "(acked, redelivered through the retry topic, or dead-lettered)"
            )
        if e.token != int(token_s, 16) or e.phy != int(phy_s):
            raise InvalidReceiptHandle(
                "receipt handle expired: the message was redelivered or its invisible time "
                "changed since (a newer handle replaces this one)"
            )
        return key, q, c, offset, e

    def ack(self, *, group: str, topic: str, handle: str) -> None:
        """The message is consumed."""
        key, q, c, offset, e = self._find(group, topic, handle)
        self._done(key, q, c, offset, e)

    def change_invisible(self, *, group: str, topic: str, handle: str, invisible_ms: int) -> Popped:
        """Invisible for ``invisible_ms`` from now, under a new handle (the old one is void)."""
        _check("invisible_ms", invisible_ms, 1, MAX_INVISIBLE_MS)
        key, q, c, offset, e = self._find(group, topic, handle)
        record = self.store.look_message_by_offset(e.phy)
        if record is None:
            self._done(key, q, c, offset, e)
            raise MessageNotFound("the message was removed from the store (retention)")
        if e.due is None:
            c.ready -= 1
        how = _How(invisible_ms, e.max_attempts, e.fifo)
        return self._deliver(key, topic, c, how, decode_record(record), e.attempt)

    def dead_letter(self, *, group: str, topic: str, handle: str, reason: str = "") -> None:
        """Copy the message to ``%DLQ%<group>`` (with its consumer's ``reason``); it is
        done."""
        if not self.ctx.replica.is_master():
            raise NotMaster("this broker is a slave: dead-letter messages on its master")
        key, q, c, offset, e = self._find(group, topic, handle)
        record = self.store.look_message_by_offset(e.phy)
        if record is None:
            self._done(key, q, c, offset, e)
            raise MessageNotFound("the message was removed from the store (retention)")
        msg = decode_record(record)
        self.retry.store_copy(
            msg,
            group,
            times=e.attempt,
            max_times=e.max_attempts - 1,
            level=-1,
            reason=reason or ON_PURPOSE,
        )
        self._done(key, q, c, offset, e)

    # -- expiry -----------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Expire in-flight messages on time, until cancelled (the broker's task group)."""
        task_status.started()
        while True:
            self._run_wake = wake = anyio.Event()
            now = time.monotonic()
            wait = min(self._expire_due(now), _SWEEP_S)
            self._compact()
            self._run_until = now + wait
            with anyio.move_on_after(wait):
                await wake.wait()

    def _expire_due(self, now: float) -> float:
        """Expire what is due; seconds until the next deadline (inf: none)."""
        heap = self._due
        while heap and heap[0][0] <= now:
            _, token, key, topic, offset = heapq.heappop(heap)
            q = self._queues.get(key)
            c = q.cursors.get(topic) if q is not None else None
            e = c.inflight.get(offset) if c is not None else None
            if q is None or c is None or e is None or e.token != token or e.due is None:
                continue  # acked, or redelivered / its time changed since
            try:
                self._expire(key, q, c, offset, e)
            except Exception as exc:  # the store refused the copy: redeliver it in place
                if isinstance(exc, TxmqError):
                    log.warning("message %s:%d of group %s: %s", key[1], offset, key[0], exc)
                else:
                    log.exception("expiring %s:%d of group %s failed", key[1], offset, key[0])
                if e.due is not None:
                    self._to_ready(c, e)
            self._wake(key[0])
        return heap[0][0] - now if heap else float("inf")

    def _expire(self, key: QueueKey, q: _Queue, c: _Cursor, offset: int, e: _Entry) -> None:
        group = key[0]
        exhausted = e.attempt >= e.max_attempts
        master = self.ctx.replica.is_master()
        if not master or (e.fifo and not exhausted):
            self._to_ready(c, e)  # redelivered in place
            return
        record = self.store.look_message_by_offset(e.phy)
        if record is None:
            log.warning("message %s:%d of group %s expired but is gone", key[1], offset, group)
        else:
            level = -1 if exhausted else 0  # -1: the DLQ; 0: the retry topic, at once
            times, max_times = e.attempt, e.max_attempts - 1
            msg = decode_record(record)
            self.retry.store_copy(msg, group, times=times, max_times=max_times, level=level)
        self._done(key, q, c, offset, e)

    @staticmethod
    def _to_ready(c: _Cursor, e: _Entry) -> None:
        e.due = None
        c.ready += 1

    def _compact(self) -> None:
        """Drop stale deadlines once they outnumber the live ones."""
        if len(self._due) <= 2 * self._live + 1024:
            return
        self._due = [
            (e.due, e.token, key, topic, offset)
            for key, q in self._queues.items()
            for topic, c in q.cursors.items()
            for offset, e in c.inflight.items()
            if e.due is not None
        ]
        heapq.heapify(self._due)
