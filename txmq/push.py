"""The push consumer: group membership, rebalance, pull loops, concurrent and orderly
consumption, send-back for retry, offsets committed as the smallest offset in flight.

A listener dead-letters a message on purpose (no retries) by returning
``ConsumeResult.DEAD_LETTER`` or raising :class:`DeadLetter` (``reason``): it is sent back
with delay level -1 and the reason, which its copy in ``%DLQ%<group>`` keeps (property
``TXMQ_DLQ_REASON``, at most 1024 characters).  A failure's send-back carries the listener's
error (``ValueError: ...``), kept as the reason once the retries are used up."""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.abc

from txmq import observe
from txmq.allocate import AllocateStrategy, MessageQueue, allocate_averagely
from txmq.errors import TopicNotFound, TxmqError, UnsupportedRequest
from txmq.message import (
    MessageExt,
    Prop,
    clip_reason,
    is_system_topic,
    retry_topic,
    used_up_reason,
)
from txmq.offset_reset import reset_queues
from txmq.offset_store import LocalFileOffsetStore, OffsetStore, RemoteOffsetStore
from txmq.process_queue import ProcessQueue
from txmq.pull import PullConsumer, PullStatus
from txmq.rpc import Call, Router
from txmq.wire import (
    ConsumerData,
    ConsumerSendMsgBack,
    Empty,
    GetConsumerListByGroup,
    Heartbeat,
    LockBatchMq,
    NotifyConsumerIdsChanged,
    ResetConsumerClientOffset,
    UnlockBatchMq,
    UnregisterClient,
)


class Receiver(Protocol):
    """Consumption where a transport has no pull (RocketMQ 5's receive and ack)."""

    def start(self, tg: anyio.abc.TaskGroup) -> None: ...

    def stop(self) -> None: ...

    async def consume(self, msg: MessageExt) -> None: ...


@runtime_checkable
class Receives(Protocol):
    """A remote whose transport consumes by receiving (``transport="grpc"``)."""

    def receiver(self, consumer: PushConsumer) -> Receiver: ...


__all__ = [
    "ConsumeFrom",
    "ConsumeResult",
    "DeadLetter",
    "Listener",
    "MessageModel",
    "PushConsumer",
    "retry_topic",
]

log = logging.getLogger("txmq.consumer")


class MessageModel(enum.StrEnum):
    CLUSTERING = "CLUSTERING"
    BROADCASTING = "BROADCASTING"


class ConsumeResult(enum.Enum):
    SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"
    #: straight to ``%DLQ%<group>``, no retries (txmq's own)
    DEAD_LETTER = "DEAD_LETTER"


class DeadLetter(Exception):
    """Raised by a listener: send this message to ``%DLQ%<group>`` at once (no retries),
    keeping ``reason`` with it (shown by ``txmq admin dlq list``).  Like returning
    ``ConsumeResult.DEAD_LETTER``, with a reason; inside ``@txmq.idempotent`` the handler's
    writes roll back and its dedupe key is not recorded."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = str(reason)


#: the reason of a DEAD_LETTER result (or a DeadLetter without one)
DEAD_LETTER_RESULT = "the listener returned DEAD_LETTER"


class ConsumeFrom(enum.StrEnum):
    LAST_OFFSET = "LAST_OFFSET"
    FIRST_OFFSET = "FIRST_OFFSET"


Listener = Callable[
    [MessageExt], "ConsumeResult | bool | Awaitable[ConsumeResult | bool | None] | None"
]
"""``listener(message)``: return SUCCESS (or None / True), or RECONSUME_LATER (or False);
raising counts as RECONSUME_LATER.  DEAD_LETTER, or raising :class:`DeadLetter`: to the
dead-letter queue at once. Sync listeners run in worker threads."""


def _by_broker(mqs: Iterable[MessageQueue]) -> dict[str, list[tuple[str, int]]]:
    """(topic, queue id) of each queue, by broker name (a lock request per broker)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for mq in sorted(mqs):
        out.setdefault(mq.broker_name, []).append((mq.topic, mq.queue_id))
    return out


def _client_id(instance_name: str) -> str:
    return f"{socket.gethostname()}@{instance_name}"


class PushConsumer(PullConsumer):
    """Consumes subscribed topics for ``group`` and calls the listener for each message.

    CLUSTERING (default): the group's members share the queues (allocation recomputed on
    start, every ``rebalance_interval`` seconds and when the broker announces a membership
    change); offsets live on the broker. BROADCASTING: every member gets every message;
    offsets live in a local file under ``offset_dir``. CONCURRENT (default) or ``orderly``:
    orderly holds a broker-side lock per queue and consumes it one message at a time.

    ``transport="grpc"`` (see :mod:`txmq.client`): RocketMQ 5 has no pull; the consumer
    receives from the queues the endpoint assigns (:mod:`txmq.grpc_receiving`), each message
    invisible to the group's other members for ``invisible_time`` seconds (renewed while its
    listener runs; default ``$TXMQ_INVISIBLE_TIME_S`` or 15: how soon the messages of a
    member that died come back).  The listener, its concurrency and results are the same.
    A new group starts where the endpoint starts it (``consume_from`` is the endpoint's);
    BROADCASTING and ``orderly`` (txmq queue locks) are txmq-protocol only: configure the
    group as FIFO on the endpoint for ordered delivery.
    """

    grpc_capable = True

    def __init__(
        self,
        address: str | None = None,
        group: str = "DEFAULT_CONSUMER",
        *,
        listener: Listener | None = None,
        message_model: MessageModel | str = MessageModel.CLUSTERING,
        orderly: bool = False,
        allocate: AllocateStrategy = allocate_averagely,
        consume_from: ConsumeFrom | str = ConsumeFrom.LAST_OFFSET,
        max_reconsume_times: int = 16,
        pull_batch_size: int = 32,
        consume_concurrency: int = 20,
        rebalance_interval: float = 20.0,
        heartbeat_interval: float = 30.0,
        persist_interval: float = 5.0,
        lock_renew_interval: float = 20.0,
        lock_max_live: float = 30.0,
        suspend_time: float = 1.0,
        pull_threshold_count: int = 1000,
        pull_threshold_size_mib: int = 100,
        max_span: int = 2000,
        long_poll: float = 15.0,
        pull_delay_on_error: float = 3.0,
        instance_name: str | None = None,
        offset_dir: str | Path | None = None,
        invisible_time: float | None = None,
        **kwargs: Any,
    ) -> None:
        router = Router("consumers")
        router.route(NotifyConsumerIdsChanged, self._on_notify)
        router.route(ResetConsumerClientOffset, self._on_reset)
        super().__init__(address, group, handler=router.handle, **kwargs)
        if self.transport == "grpc":
            if MessageModel(message_model) is MessageModel.BROADCASTING:
                raise UnsupportedRequest(
                    "BROADCASTING over transport='grpc': RocketMQ 5's protocol has no "
                    "broadcasting consumption (use transport='txmq')"
                )
            if orderly:
                raise UnsupportedRequest(
                    "orderly=True over transport='grpc': orderly consumption holds txmq queue "
                    "locks, which RocketMQ 5's protocol has not; make the group FIFO on the "
                    "endpoint instead (it then delivers a message group in order)"
                )
        if invisible_time is None:
            invisible_time = float(os.environ.get("TXMQ_INVISIBLE_TIME_S") or 15.0)
        if not invisible_time > 0:
            raise ValueError("invisible_time must be positive")
        self.invisible_time = invisible_time
        self._receiver: Receiver | None = None
        self.listener = listener
        self.message_model = MessageModel(message_model)
        self.orderly = orderly
        self.allocate = allocate
        self.consume_from = ConsumeFrom(consume_from)
        self.max_reconsume_times = max_reconsume_times
        self.pull_batch_size = pull_batch_size
        self.rebalance_interval = rebalance_interval
        self.heartbeat_interval = heartbeat_interval
        self.persist_interval = persist_interval
        self.lock_renew_interval = lock_renew_interval
        self.lock_max_live = lock_max_live
        self.suspend_time = suspend_time
        self.pull_threshold_count = pull_threshold_count
        self.pull_threshold_size = pull_threshold_size_mib * 1024 * 1024
        self.max_span = max_span
        self.long_poll = long_poll
        self.pull_delay_on_error = pull_delay_on_error
        self.instance_name = instance_name or str(os.getpid())
        self.client_id = _client_id(self.instance_name)
        self.subscriptions: dict[str, str] = {}
        #: subscribed topics with no route (warned about once, until they have one)
        self._unrouted: set[str] = set()
        self.queues_held: dict[MessageQueue, ProcessQueue] = {}
        self._scopes: dict[MessageQueue, anyio.CancelScope] = {}
        self.consume_concurrency = consume_concurrency
        self._limiter = anyio.CapacityLimiter(consume_concurrency)
        # concurrent consumption: a fixed pool of workers fed by the pull loops
        self._work: asyncio.Queue[tuple[MessageQueue, ProcessQueue, MessageExt]] = asyncio.Queue()
        self._rebalance_now = anyio.Event()
        self._rebalance_lock = anyio.Lock()
        self._stopping = False
        self.offsets: OffsetStore
        if self.message_model is MessageModel.BROADCASTING:
            base = Path(offset_dir) if offset_dir else Path.home() / ".txmq" / "offsets"
            self.offsets = LocalFileOffsetStore(base / self.instance_name / group / "offsets.json")
        else:
            self.offsets = RemoteOffsetStore(self)

    # -- configuration ---------------------------------------------------------------------

    def subscribe(self, topic: str, expression: str = "*") -> None:
        if is_system_topic(topic):
            raise ValueError(f"cannot subscribe to the system topic {topic!r}")
        self.subscriptions[topic] = expression or "*"

    def register_listener(self, listener: Listener) -> None:
        self.listener = listener

    def _all_subscriptions(self) -> dict[str, str]:
        subs = dict(self.subscriptions)
        if self.message_model is MessageModel.CLUSTERING:
            subs[retry_topic(self.group)] = "*"
        return subs

    # -- lifecycle -------------------------------------------------------------------------

    async def _on_start(self) -> None:
        if self.listener is None:
            raise ValueError("register a listener before starting the consumer")
        if not self.subscriptions:
            raise ValueError("subscribe to at least one topic before starting the consumer")
        self._stopping = False
        await self.connect()
        await self._heartbeat()
        tg = self._task_group()
        tg.start_soon(self._heartbeat_loop)
        remote = self.remote() if self.transport != "txmq" else None
        if isinstance(remote, Receives):
            self._receiver = remote.receiver(self)
            for _ in range(self.consume_concurrency):
                tg.start_soon(self._consume_worker)
            self._receiver.start(tg)
            return
        tg.start_soon(self._rebalance_loop)
        tg.start_soon(self._persist_loop)
        if self.orderly and self.message_model is MessageModel.CLUSTERING:
            tg.start_soon(self._lock_loop)
        if not self.orderly:
            for _ in range(self.consume_concurrency):
                tg.start_soon(self._consume_worker)
        await self.rebalance()

    async def _on_stop(self) -> None:
        self._stopping = True
        if self._receiver is not None:
            self._receiver.stop()
            with anyio.move_on_after(5):
                await self._unregister(
                    UnregisterClient(client_id=self.client_id, consumer_groups=[self.group])
                )
            return
        async with self._rebalance_lock:  # no rebalance may pick queues up again meanwhile
            held = set(self.queues_held)
            for mq in list(held):
                self._drop(mq)
        with anyio.move_on_after(5):
            try:
                await self.offsets.persist(held)
            except (TxmqError, OSError) as exc:
                log.warning("persisting offsets at shutdown failed: %s", exc)
            if self.orderly and self.message_model is MessageModel.CLUSTERING and held:
                await self._unlock(held)
            await self._unregister(
                UnregisterClient(client_id=self.client_id, consumer_groups=[self.group])
            )

    def _on_notify(self, request: NotifyConsumerIdsChanged, call: Call) -> Empty:
        self._rebalance_now.set()
        return Empty()

    def _on_reset(self, request: ResetConsumerClientOffset, call: Call) -> Empty:
        """An operator reset the group's offsets of a topic on a broker: consume its
        queues held here from the new offsets (:mod:`txmq.offset_reset`)."""
        if request.group == self.group and not self._stopping:
            self._task_group().start_soon(reset_queues, self, request)
        return Empty()

    # -- heartbeats, rebalance, offsets ----------------------------------------------------

    def _heartbeat_request(self) -> Heartbeat:
        consumer = ConsumerData(
            group=self.group,
            message_model="BROADCASTING"
            if self.message_model is MessageModel.BROADCASTING
            else "CLUSTERING",
            consume_type="ORDERLY" if self.orderly else "CONCURRENTLY",
            subscriptions=self._all_subscriptions(),
        )
        return Heartbeat(client_id=self.client_id, consumers=[consumer])

    async def _rebalance_loop(self) -> None:
        while True:
            with anyio.move_on_after(self.rebalance_interval):
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
            await anyio.sleep(self.persist_interval)
            try:
                await self.offsets.persist(set(self.queues_held))
            except (TxmqError, OSError) as exc:
                log.warning("persisting offsets failed: %s", exc)
            except Exception:
                log.exception("persisting offsets failed unexpectedly")

    async def consumer_ids(self, broker_name: str | None = None) -> list[str]:
        """The group's members, as a broker of the group's topics knows them (every member
        heartbeats every broker of its subscriptions)."""
        request = GetConsumerListByGroup(group=self.group)
        return sorted((await self.call(request, broker=broker_name, replica="any")).client_ids)

    async def rebalance(self) -> None:
        """Recompute which queues this member consumes, and start or stop their pulls."""
        async with self._rebalance_lock:
            if self._stopping:
                return
            for topic in self._all_subscriptions():
                try:
                    route = await self.route(topic, refresh=True)
                except TopicNotFound:
                    self._no_route(topic)
                    continue
                self._unrouted.discard(topic)
                mqs = sorted(route.read_queues)
                await self._reach(self.routes.replica_addresses(route))
                if self.message_model is MessageModel.BROADCASTING:
                    mine = set(mqs)
                elif not mqs:
                    mine = set()
                else:
                    cids = await self._members(sorted({mq.broker_name for mq in mqs}))
                    mine = set(self.allocate(self.group, self.client_id, mqs, cids))
                await self._update_queues(topic, mine)

    def _no_route(self, topic: str) -> None:
        """Say once (a WARNING; again only after it had a route) that a subscribed topic
        has none; its own retry topic, made on first use, only at DEBUG."""
        if topic in self._unrouted or topic not in self.subscriptions:
            log.debug("topic %s has no route yet", topic)
            return
        self._unrouted.add(topic)
        log.warning(
            "topic %s has no route: no broker holds it (yet); group %s consumes it once one does",
            topic,
            self.group,
        )

    async def _members(self, brokers: list[str]) -> list[str]:
        """The group's members as the first broker of the topic that answers knows them
        (a broker set that is down does not stop the others' rebalance)."""
        error: TxmqError | None = None
        for broker in brokers:
            try:
                return await self.consumer_ids(broker)
            except TxmqError as exc:
                error = exc
        assert error is not None
        raise error

    async def _reach(self, addresses: Iterable[str]) -> None:
        """Connect to each broker (a new connection starts with this member's heartbeat,
        so that every broker of a subscription knows the group's members)."""
        for address in addresses:
            try:
                await self.routes.remote(address).connection()
            except TxmqError as exc:
                log.warning("broker %s is unreachable: %s", address, exc)

    async def _update_queues(self, topic: str, mine: set[MessageQueue]) -> None:
        gone = {mq for mq in self.queues_held if mq.topic == topic and mq not in mine}
        for mq in gone:
            self._drop(mq)
        if gone:
            try:
                await self.offsets.persist(gone)
            except TxmqError as exc:
                log.warning("committing offsets of released queues failed: %s", exc)
            if self.orderly and self.message_model is MessageModel.CLUSTERING:
                await self._unlock(gone)
            for mq in gone:
                self.offsets.remove(mq)
        new = sorted(mine - set(self.queues_held))
        if new and self.orderly and self.message_model is MessageModel.CLUSTERING:
            new = sorted(await self._lock(set(new)))
        for mq in new:
            self._start_queue(mq, await self._start_offset(mq))
        if gone or new:
            log.info("%s/%s now consumes %s", self.group, self.client_id, sorted(self.queues_held))

    def _start_queue(
        self, mq: MessageQueue, offset: int, lock: tuple[bool, float] | None = None
    ) -> None:
        """Pull and consume ``mq`` from ``offset`` (orderly: ``lock`` is whether the queue
        is locked and since when; None: locked now)."""
        pq = ProcessQueue()
        if self.orderly:
            pq.locked, pq.last_lock_time = lock or (True, time.monotonic())
        self.queues_held[mq] = pq
        scope = self._scopes[mq] = anyio.CancelScope()
        self._task_group().start_soon(self._run_queue, mq, pq, offset, scope)

    def _drop(self, mq: MessageQueue) -> None:
        pq = self.queues_held.pop(mq, None)
        if pq is not None:
            pq.dropped = True
            pq.arrived.set()
        scope = self._scopes.pop(mq, None)
        if scope is not None:
            scope.cancel()

    async def _start_offset(self, mq: MessageQueue) -> int:
        offset = await self.offsets.read(mq)
        if offset >= 0:
            return offset
        if self.consume_from is ConsumeFrom.FIRST_OFFSET or mq.topic.startswith("%RETRY%"):
            return await self.min_offset(mq.topic, mq.queue_id, broker_name=mq.broker_name)
        return await self.max_offset(mq.topic, mq.queue_id, broker_name=mq.broker_name)

    # -- queue locks (orderly) -------------------------------------------------------------

    async def _lock(self, mqs: set[MessageQueue]) -> set[MessageQueue]:
        """Lock (or renew) queues, each on its own broker; the ones now held."""
        held: set[MessageQueue] = set()
        for broker, refs in _by_broker(mqs).items():
            request = LockBatchMq(group=self.group, client_id=self.client_id, queues=refs)
            try:
                locked = (await self.call(request, broker=broker)).locked
            except TxmqError as exc:
                if len(_by_broker(mqs)) == 1:
                    raise
                log.warning("locking queues on broker %s failed: %s", broker, exc)
                continue
            held |= {MessageQueue(t, broker, q) for t, q in locked}
        return held

    async def _unlock(self, mqs: set[MessageQueue]) -> None:
        for broker, refs in _by_broker(mqs).items():
            request = UnlockBatchMq(group=self.group, client_id=self.client_id, queues=refs)
            try:
                await self.call(request, broker=broker)
            except TxmqError as exc:
                log.warning("unlocking queues on broker %s failed: %s", broker, exc)

    async def _lock_loop(self) -> None:
        while True:
            await anyio.sleep(self.lock_renew_interval)
            held = dict(self.queues_held)
            if not held:
                continue
            try:
                locked = await self._lock(set(held))
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
        if pq.count > self.pull_threshold_count or pq.size > self.pull_threshold_size:
            return True
        return not self.orderly and pq.span > self.max_span

    async def _run_queue(
        self, mq: MessageQueue, pq: ProcessQueue, offset: int, scope: anyio.CancelScope
    ) -> None:
        with scope:
            async with anyio.create_task_group() as tg:
                if self.orderly:
                    tg.start_soon(self._orderly_loop, mq, pq)
                await self._pull_loop(mq, pq, offset, tg)

    async def _pull_loop(
        self, mq: MessageQueue, pq: ProcessQueue, offset: int, tg: anyio.abc.TaskGroup
    ) -> None:
        topic, broker, queue_id = mq
        expression = self._all_subscriptions().get(topic, "*")
        while not pq.dropped:
            if self._flow_blocked(pq):
                await anyio.sleep(0.05)
                continue
            try:
                res = await self.pull(
                    topic,
                    queue_id,
                    offset,
                    max_msgs=self.pull_batch_size,
                    subscription=expression,
                    long_poll=self.long_poll,
                    broker_name=broker,
                )
            except TxmqError as exc:
                log.warning("pull %s failed: %s", mq, exc)
                await anyio.sleep(self.pull_delay_on_error)
                continue
            pq.last_pull_time = time.monotonic()
            if pq.dropped:
                return
            if res.status is PullStatus.FOUND:
                msgs = res.messages
                for m in msgs:
                    _reset_retry_topic(m)
                pq.put(msgs)
                if not self.orderly:
                    for m in msgs:
                        self._work.put_nowait((mq, pq, m))
            elif res.status is PullStatus.OFFSET_ILLEGAL:
                log.warning("offset %d of %s is illegal; moving to %d", offset, mq, res.next_offset)
                self.offsets.update(mq, res.next_offset)
            elif not pq.msgs and not pq.consuming:
                # an empty answer with nothing in flight: everything up to here is consumed
                # (also moves past messages filtered out by tag)
                if res.next_offset > offset and pq.max_offset < res.next_offset:
                    self.offsets.update(mq, res.next_offset)
            offset = res.next_offset

    # -- consuming -------------------------------------------------------------------------

    async def _invoke(self, msg: MessageExt) -> ConsumeResult:
        """Run the listener on ``msg`` (every transport and consumption mode comes here:
        inside its ``process`` span, timed for the client metrics)."""
        return (await self._invoke_why(msg))[0]

    async def _invoke_why(self, msg: MessageExt) -> tuple[ConsumeResult, str]:
        """:meth:`_invoke`, and why when it is not SUCCESS: a dead letter's reason, the
        listener's error ("" for a RECONSUME_LATER)."""
        listener = self.listener
        assert listener is not None
        with observe.consuming(
            self.group,
            msg.topic,
            msg.msg_id,
            msg.all_properties,
            queue_id=msg.queue_id,
            reconsume_times=msg.reconsume_times,
            body_size=len(msg.body),
            model=self.message_model.value.lower(),
        ) as obs:
            try:
                if inspect.iscoroutinefunction(listener):
                    result = await listener(msg)  # concurrency is bounded by the worker pool
                else:
                    result = await anyio.to_thread.run_sync(listener, msg, limiter=self._limiter)
                    if inspect.isawaitable(result):
                        result = await result
            except DeadLetter as exc:
                result, reason = ConsumeResult.DEAD_LETTER, exc.reason or DEAD_LETTER_RESULT
            except Exception as exc:
                log.warning(
                    "listener failed on %s (reconsume %d): %r", msg.msg_id, msg.reconsume_times, exc
                )
                obs.failed(exc)
                return ConsumeResult.RECONSUME_LATER, clip_reason(f"{type(exc).__name__}: {exc}")
            else:
                reason = DEAD_LETTER_RESULT
            if result is None or result is True or result is ConsumeResult.SUCCESS:
                return ConsumeResult.SUCCESS, ""
            if result is ConsumeResult.DEAD_LETTER:
                log.warning("listener dead-lettered %s: %r", msg.msg_id, reason)
                obs.result("dead_letter")
                return ConsumeResult.DEAD_LETTER, clip_reason(reason)
            obs.result("reconsume_later")
            return ConsumeResult.RECONSUME_LATER, ""

    async def _consume_worker(self) -> None:
        while True:
            mq, pq, msg = await self._work.get()
            if self._receiver is not None:
                await self._receiver.consume(msg)
            elif not pq.dropped:
                await self._consume_concurrently(mq, pq, msg)

    async def _retry_locally(self, mq: MessageQueue, pq: ProcessQueue, msg: MessageExt) -> None:
        await anyio.sleep(5)  # the broker did not take the message back: consume it here again
        msg.reconsume_times += 1
        self._work.put_nowait((mq, pq, msg))

    async def _consume_concurrently(
        self, mq: MessageQueue, pq: ProcessQueue, msg: MessageExt
    ) -> None:
        status, why = await self._invoke_why(msg)
        if pq.dropped:
            return  # the queue moved away: its new owner commits from here on
        if status is not ConsumeResult.SUCCESS:
            level = -1 if status is ConsumeResult.DEAD_LETTER else 0
            if self.message_model is MessageModel.BROADCASTING:
                log.warning("broadcast message %s failed; dropped", msg.msg_id)
            elif not await self.send_back(msg, level, reason=why):
                self._task_group().start_soon(self._retry_locally, mq, pq, msg)
                return
        offset = pq.remove(msg)
        if offset >= 0 and not pq.dropped:
            self.offsets.update(mq, offset)

    async def send_back(self, msg: MessageExt, delay_level: int = 0, *, reason: str = "") -> bool:
        """Hand a failed message back to the broker for retry (delay level 0: the broker's
        choice, 3 + reconsume times; -1: straight to the dead-letter queue), saying why
        (kept by a dead-letter copy)."""
        try:
            await self.call(
                ConsumerSendMsgBack(
                    group=self.group,
                    commit_log_offset=msg.commit_log_offset,
                    delay_level=delay_level,
                    max_reconsume_times=self.max_reconsume_times,
                    origin_msg_id=msg.msg_id,
                    reason=clip_reason(reason),
                ),
                broker=msg.broker_name or None,  # the broker it came from holds its record
            )
        except TxmqError as exc:
            log.warning("sending %s back failed: %s", msg.msg_id, exc)
            return False
        return True

    async def _orderly_loop(self, mq: MessageQueue, pq: ProcessQueue) -> None:
        clustering = self.message_model is MessageModel.CLUSTERING
        while not pq.dropped:
            if clustering and (not pq.locked or pq.lock_expired(self.lock_max_live)):
                await anyio.sleep(0.1)
                continue
            msg = pq.take()
            if msg is None:
                await pq.arrived.wait()
                continue
            status, why = await self._invoke_why(msg)
            if pq.dropped:
                return
            if status is ConsumeResult.SUCCESS:
                offset = pq.commit_taken()
            else:
                dead = status is ConsumeResult.DEAD_LETTER  # on purpose: no local retries
                if not dead:
                    msg.reconsume_times += 1
                if not dead and msg.reconsume_times <= self.max_reconsume_times:
                    pq.give_back()
                    await anyio.sleep(self.suspend_time)  # suspend this queue a moment
                    continue
                if not clustering:  # broadcasting has no dead-letter queue
                    log.warning("orderly broadcast message %s dropped", msg.msg_id)
                    offset = pq.commit_taken()
                elif await self.send_back(
                    msg,
                    delay_level=-1,
                    reason=why if dead else used_up_reason(self.max_reconsume_times, why),
                ):
                    offset = pq.commit_taken()  # dead-lettered: the queue moves on
                else:
                    pq.give_back()
                    await anyio.sleep(self.suspend_time)
                    continue
            if offset >= 0:
                self.offsets.update(mq, offset)


def _reset_retry_topic(msg: MessageExt) -> None:
    """A message pulled from the retry topic is shown with its original topic."""
    origin = msg.all_properties.get(Prop.RETRY_TOPIC)
    if origin and msg.topic.startswith("%RETRY%"):
        msg.topic = origin
