"""A push consumer's consumption by pulling (txmq's own protocol): which queues this member
holds (rebalance), a long-polling pull loop per queue with flow control, concurrent or
orderly consumption, queue locks (orderly), offsets committed as the smallest offset in
flight, and the periodic rounds that keep all of it going.

:class:`PullMode` is the push consumer's part that pulls; it sees the consumer through
:class:`Owner`, the consumer's public side (its settings, its listener, its workers)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Protocol

import anyio
import anyio.abc

from txmq.client.core import Replica
from txmq.client.route import Route, RouteTable
from txmq.consumer.allocate import AllocateStrategy
from txmq.consumer.model import ConsumeFrom, ConsumeResult, MessageModel
from txmq.consumer.offsets import OffsetStore
from txmq.consumer.process_queue import ProcessQueue
from txmq.consumer.pull import Puller, PullResult, PullStatus
from txmq.protocol.message import MessageExt, MessageQueue, Prop, used_up_reason
from txmq.protocol.wire import LockBatchMq, UnlockBatchMq
from txmq.protocol.wire.base import R, Request
from txmq.protocol.wire.errors import TopicNotFound, TxmqError

__all__ = ["Owner", "PullMode"]

log = logging.getLogger("txmq.consumer")


class Owner(Protocol):
    """What pulling needs of the push consumer it pulls for."""

    group: str
    client_id: str
    message_model: MessageModel
    orderly: bool
    allocate: AllocateStrategy
    consume_from: ConsumeFrom
    max_reconsume_times: int
    pull_batch_size: int
    rebalance_interval: float
    persist_interval: float
    lock_renew_interval: float
    lock_max_live: float
    suspend_time: float
    pull_threshold_count: int
    pull_threshold_size: int
    max_span: int
    long_poll: float
    pull_delay_on_error: float
    routes: RouteTable
    puller: Puller
    offsets: OffsetStore

    def all_subscriptions(self) -> Mapping[str, str]: ...

    async def consumer_ids(self, broker_name: str | None = None) -> list[str]: ...

    def routed(self, topic: str, found: bool) -> None: ...

    def submit(self, job: Callable[[], Awaitable[None]]) -> None: ...

    async def invoke(self, msg: MessageExt) -> tuple[ConsumeResult, str]: ...

    async def send_back(
        self, msg: MessageExt, delay_level: int = 0, *, reason: str = ""
    ) -> bool: ...

    async def call(
        self,
        request: Request[R],
        body: bytes = b"",
        *,
        timeout: float | None = None,
        broker: str | None = None,
        replica: Replica = "master",
    ) -> R: ...

    async def route(self, topic: str, *, create: bool = False, refresh: bool = False) -> Route: ...


def _by_broker(mqs: Iterable[MessageQueue]) -> dict[str, list[tuple[str, int]]]:
    """(topic, queue id) of each queue, by broker name (a lock request per broker)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for mq in sorted(mqs):
        out.setdefault(mq.broker_name, []).append((mq.topic, mq.queue_id))
    return out


class PullMode:
    """The queues one push consumer holds and pulls (see the module's documentation)."""

    def __init__(self, consumer: Owner) -> None:
        self.consumer = consumer
        #: the queues this member holds, each with its process queue
        self.held: dict[MessageQueue, ProcessQueue] = {}
        self._scopes: dict[MessageQueue, anyio.CancelScope] = {}
        #: held while queues are started or stopped (a rebalance, a reset, stopping)
        self.changes = anyio.Lock()
        self._rebalance_now = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self.stopping = False

    @property
    def _clustering_orderly(self) -> bool:
        c = self.consumer
        return c.orderly and c.message_model is MessageModel.CLUSTERING

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the periodic rounds in ``tg`` and take this member's queues now."""
        self.stopping = False
        self._tg = tg
        tg.start_soon(self._rebalance_loop)
        tg.start_soon(self._persist_loop)
        if self._clustering_orderly:
            tg.start_soon(self._lock_loop)
        await self.rebalance()

    async def stop(self) -> None:
        """Stop every queue, commit their offsets and release their locks."""
        self.stopping = True
        async with self.changes:  # no rebalance may pick queues up again meanwhile
            held = set(self.held)
            for mq in list(held):
                self.drop(mq)
        try:
            await self.consumer.offsets.persist(held)
        except (TxmqError, OSError) as exc:
            log.warning("persisting offsets at shutdown failed: %s", exc)
        if self._clustering_orderly and held:
            await self.unlock(held)

    def rebalance_soon(self) -> None:
        """Rebalance now rather than at the next round (the group's members changed)."""
        self._rebalance_now.set()

    # -- rebalance -------------------------------------------------------------------------

    async def _rebalance_loop(self) -> None:
        while True:
            with anyio.move_on_after(self.consumer.rebalance_interval):
                await self._rebalance_now.wait()
            self._rebalance_now = anyio.Event()
            try:
                await self.rebalance()
            except TxmqError as exc:
                log.warning("rebalance failed: %s", exc)
            except Exception:  # a bug here must not end the consumer (the next round may work)
                log.exception("rebalance failed unexpectedly")

    async def _persist_loop(self) -> None:
        while True:
            await anyio.sleep(self.consumer.persist_interval)
            try:
                await self.consumer.offsets.persist(set(self.held))
            except (TxmqError, OSError) as exc:
                log.warning("persisting offsets failed: %s", exc)
            except Exception:
                log.exception("persisting offsets failed unexpectedly")

    async def rebalance(self) -> None:
        """Recompute which queues this member consumes, and start or stop their pulls."""
        c = self.consumer
        async with self.changes:
            if self.stopping:
                return
            for topic in c.all_subscriptions():
                try:
                    route = await c.route(topic, refresh=True)
                except TopicNotFound:
                    c.routed(topic, False)
                    continue
                c.routed(topic, True)
                mqs = sorted(route.read_queues)
                await self._reach(c.routes.replica_addresses(route))
                if c.message_model is MessageModel.BROADCASTING:
                    mine = set(mqs)
                elif not mqs:
                    mine = set()
                else:
                    cids = await self._members(sorted({mq.broker_name for mq in mqs}))
                    mine = set(c.allocate(c.group, c.client_id, mqs, cids))
                await self._update_queues(topic, mine)

    async def _members(self, brokers: list[str]) -> list[str]:
        """The group's members as the first broker of the topic that answers knows them
        (a broker set that is down does not stop the others' rebalance)."""
        error: TxmqError | None = None
        for broker in brokers:
            try:
                return await self.consumer.consumer_ids(broker)
            except TxmqError as exc:
                error = exc
        assert error is not None
        raise error

    async def _reach(self, addresses: Iterable[str]) -> None:
        """Connect to each broker (a new connection starts with this member's heartbeat,
        so that every broker of a subscription knows the group's members)."""
        for address in addresses:
            try:
                await self.consumer.routes.remote(address).connection()
            except TxmqError as exc:
                log.warning("broker %s is unreachable: %s", address, exc)

    async def _update_queues(self, topic: str, mine: set[MessageQueue]) -> None:
        c = self.consumer
        gone = {mq for mq in self.held if mq.topic == topic and mq not in mine}
        for mq in gone:
            self.drop(mq)
        if gone:
            try:
                await c.offsets.persist(gone)
            except TxmqError as exc:
                log.warning("committing offsets of released queues failed: %s", exc)
            if self._clustering_orderly:
                await self.unlock(gone)
            for mq in gone:
                c.offsets.remove(mq)
        new = sorted(mine - set(self.held))
        if new and self._clustering_orderly:
            new = sorted(await self.lock(set(new)))
        for mq in new:
            self.start_queue(mq, await self._start_offset(mq))
        if gone or new:
            log.info("%s/%s now consumes %s", c.group, c.client_id, sorted(self.held))

    def start_queue(
        self, mq: MessageQueue, offset: int, lock: tuple[bool, float] | None = None
    ) -> None:
        """Pull and consume ``mq`` from ``offset`` (orderly: ``lock`` is whether the queue
        is locked and since when; None: locked now)."""
        assert self._tg is not None, "start() first"
        pq = ProcessQueue()
        if self.consumer.orderly:
            pq.locked, pq.last_lock_time = lock or (True, time.monotonic())
        self.held[mq] = pq
        scope = self._scopes[mq] = anyio.CancelScope()
        self._tg.start_soon(self._run_queue, mq, pq, offset, scope)

    def drop(self, mq: MessageQueue) -> None:
        """Stop pulling and consuming ``mq``: what was pulled and not consumed is dropped,
        and a listener call still running commits nothing."""
        pq = self.held.pop(mq, None)
        if pq is not None:
            pq.dropped = True
            pq.arrived.set()
        scope = self._scopes.pop(mq, None)
        if scope is not None:
            scope.cancel()

    async def _start_offset(self, mq: MessageQueue) -> int:
        c = self.consumer
        offset = await c.offsets.read(mq)
        if offset >= 0:
            return offset
        if c.consume_from is ConsumeFrom.FIRST_OFFSET or mq.topic.startswith("%RETRY%"):
            return await c.puller.min_offset(mq.topic, mq.queue_id, broker_name=mq.broker_name)
        return await c.puller.max_offset(mq.topic, mq.queue_id, broker_name=mq.broker_name)

    # -- queue locks (orderly) -------------------------------------------------------------

    async def lock(self, mqs: set[MessageQueue]) -> set[MessageQueue]:
        """Lock (or renew) queues, each on its own broker; the ones now held."""
        c = self.consumer
        held: set[MessageQueue] = set()
        brokers = _by_broker(mqs)
        for broker, refs in brokers.items():
            request = LockBatchMq(group=c.group, client_id=c.client_id, queues=refs)
            try:
                locked = (await c.call(request, broker=broker)).locked
            except TxmqError as exc:
                if len(brokers) == 1:
                    raise
                log.warning("locking queues on broker %s failed: %s", broker, exc)
                continue
            held |= {MessageQueue(t, broker, q) for t, q in locked}
        return held

    async def unlock(self, mqs: set[MessageQueue]) -> None:
        c = self.consumer
        for broker, refs in _by_broker(mqs).items():
            request = UnlockBatchMq(group=c.group, client_id=c.client_id, queues=refs)
            try:
                await c.call(request, broker=broker)
            except TxmqError as exc:
                log.warning("unlocking queues on broker %s failed: %s", broker, exc)

    async def _lock_loop(self) -> None:
        while True:
            await anyio.sleep(self.consumer.lock_renew_interval)
            held = dict(self.held)
            if not held:
                continue
            try:
                locked = await self.lock(set(held))
            except TxmqError as exc:
                log.warning("renewing queue locks failed: %s", exc)
                continue
            except Exception:
                log.exception("renewing queue locks failed unexpectedly")
                continue
            now = time.monotonic()
            for mq, pq in held.items():
                pq.locked = mq in locked
                if pq.locked:
                    pq.last_lock_time = now

    # -- pulling ---------------------------------------------------------------------------

    def _flow_blocked(self, pq: ProcessQueue) -> bool:
        c = self.consumer
        if pq.count > c.pull_threshold_count or pq.size > c.pull_threshold_size:
            return True
        return not c.orderly and pq.span > c.max_span

    async def _run_queue(
        self, mq: MessageQueue, pq: ProcessQueue, offset: int, scope: anyio.CancelScope
    ) -> None:
        with scope:
            async with anyio.create_task_group() as tg:
                if self.consumer.orderly:
                    tg.start_soon(self._orderly_loop, mq, pq)
                await self._pull_loop(mq, pq, offset)

    async def _pull_loop(self, mq: MessageQueue, pq: ProcessQueue, offset: int) -> None:
        c = self.consumer
        topic, broker, queue_id = mq
        expression = c.all_subscriptions().get(topic, "*")
        while not pq.dropped:
            if self._flow_blocked(pq):
                await anyio.sleep(0.05)
                continue
            try:
                res = await c.puller.pull(
                    topic,
                    queue_id,
                    offset,
                    max_msgs=c.pull_batch_size,
                    subscription=expression,
                    long_poll=c.long_poll,
                    broker_name=broker,
                )
            except TxmqError as exc:
                log.warning("pull %s failed: %s", mq, exc)
                await anyio.sleep(c.pull_delay_on_error)
                continue
            pq.last_pull_time = time.monotonic()
            if pq.dropped:
                return
            if res.status is PullStatus.FOUND:
                msgs = res.messages
                for m in msgs:
                    _reset_retry_topic(m)
                pq.put(msgs)
                if not c.orderly:
                    for m in msgs:
                        c.submit(functools.partial(self._consume, mq, pq, m))
            elif res.status is PullStatus.OFFSET_ILLEGAL:
                self._moved(mq, pq, offset, res)
                return
            elif not pq.msgs and not pq.consuming:
                # an empty answer with nothing in flight: everything up to here is consumed
                # (also moves past messages filtered out by tag)
                if res.next_offset > offset and pq.max_offset < res.next_offset:
                    c.offsets.update(mq, res.next_offset)
            offset = res.next_offset

    def _moved(self, mq: MessageQueue, pq: ProcessQueue, offset: int, res: PullResult) -> None:
        """The broker says ``offset`` is outside ``mq`` and to go on at ``res.next_offset``:
        the records there were deleted (it is ahead), or a new master lacks the last records
        the old one had (it is behind: they were never acknowledged, and the new master
        writes its own at those offsets).  The queue starts again, with a new process
        queue, from the first message pulled and not yet consumed when that comes earlier:
        those are delivered again (at least once).  Committing ``next_offset`` over them
        would skip them for good should this process die before they are consumed — a
        saga's replies did, after a failover under load."""
        first = pq.first()
        restart = res.next_offset if first < 0 else min(first, res.next_offset)
        log.warning(
            "offset %d of %s is outside the queue (%d to %d); consuming again from %d%s",
            offset,
            mq,
            res.min_offset,
            res.max_offset,
            restart,
            f" ({pq.count} message(s) in flight delivered again)" if first >= 0 else "",
        )
        self.consumer.offsets.reset(mq, restart)
        lock = (pq.locked, pq.last_lock_time) if self.consumer.orderly else None
        self.drop(mq)  # what is still being consumed commits nothing
        self.start_queue(mq, restart, lock)

    # -- consuming -------------------------------------------------------------------------

    async def _retry_locally(self, mq: MessageQueue, pq: ProcessQueue, msg: MessageExt) -> None:
        await anyio.sleep(5)  # the broker did not take the message back: consume it here again
        msg.reconsume_times += 1
        self.consumer.submit(functools.partial(self._consume, mq, pq, msg))

    async def _consume(self, mq: MessageQueue, pq: ProcessQueue, msg: MessageExt) -> None:
        """Concurrent consumption of one pulled message (on one of the consumer's workers)."""
        if pq.dropped:
            return
        c = self.consumer
        status, why = await c.invoke(msg)
        if pq.dropped:
            return  # the queue moved away: its new owner commits from here on
        if status is not ConsumeResult.SUCCESS:
            level = -1 if status is ConsumeResult.DEAD_LETTER else 0
            if c.message_model is MessageModel.BROADCASTING:
                log.warning("broadcast message %s failed; dropped", msg.msg_id)
            elif not await c.send_back(msg, level, reason=why):
                assert self._tg is not None
                self._tg.start_soon(self._retry_locally, mq, pq, msg)
                return
        offset = pq.remove(msg)
        if offset >= 0 and not pq.dropped:
            c.offsets.update(mq, offset)

    async def _orderly_loop(self, mq: MessageQueue, pq: ProcessQueue) -> None:
        c = self.consumer
        clustering = c.message_model is MessageModel.CLUSTERING
        while not pq.dropped:
            if clustering and (not pq.locked or pq.lock_expired(c.lock_max_live)):
                await anyio.sleep(0.1)
                continue
            msg = pq.take()
            if msg is None:
                await pq.arrived.wait()
                continue
            status, why = await c.invoke(msg)
            if pq.dropped:
                return
            if status is ConsumeResult.SUCCESS:
                offset = pq.commit_taken()
            else:
                dead = status is ConsumeResult.DEAD_LETTER  # on purpose: no local retries
                if not dead:
                    msg.reconsume_times += 1
                if not dead and msg.reconsume_times <= c.max_reconsume_times:
                    pq.give_back()
                    await anyio.sleep(c.suspend_time)  # suspend this queue a moment
                    continue
                if not clustering:  # broadcasting has no dead-letter queue
                    log.warning("orderly broadcast message %s dropped", msg.msg_id)
                    offset = pq.commit_taken()
                elif await c.send_back(
                    msg,
                    delay_level=-1,
                    reason=why if dead else used_up_reason(c.max_reconsume_times, why),
                ):
                    offset = pq.commit_taken()  # dead-lettered: the queue moves on
                else:
                    pq.give_back()
                    await anyio.sleep(c.suspend_time)
                    continue
            if offset >= 0:
                c.offsets.update(mq, offset)


def _reset_retry_topic(msg: MessageExt) -> None:
    """A message pulled from the retry topic is shown with its original topic."""
    origin = msg.all_properties.get(Prop.RETRY_TOPIC)
    if origin and msg.topic.startswith("%RETRY%"):
        msg.topic = origin
