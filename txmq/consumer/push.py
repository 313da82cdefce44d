"""The push consumer: group membership, listener dispatch on a pool of workers, send-back
for retry, and consumption by pulling (:mod:`txmq.consumer.pulling`) or, over a transport
with no pulls, by receiving (the transport's receiver, :mod:`txmq.transports.port`).

A listener dead-letters a message on purpose (no retries) by returning
``ConsumeResult.DEAD_LETTER`` or raising :class:`DeadLetter` (``reason``): it is sent back
with delay level -1 and the reason, which its copy in ``%DLQ%<group>`` keeps (property
``TXMQ_DLQ_REASON``, at most 1024 characters).  A failure's send-back carries the listener's
error (``ValueError: ...``), kept as the reason once the retries are used up."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from txmq.client.core import BrokerClient
from txmq.consumer.allocate import AllocateStrategy, allocate_averagely
from txmq.consumer.model import (
    DEAD_LETTER_RESULT,
    ConsumeFrom,
    ConsumeResult,
    DeadLetter,
    Listener,
    MessageModel,
)
from txmq.consumer.offsets import LocalFileOffsetStore, OffsetStore, RemoteOffsetStore
from txmq.consumer.process_queue import ProcessQueue
from txmq.consumer.pull import Puller
from txmq.consumer.pulling import PullMode
from txmq.consumer.reset import reset_queues
from txmq.observability import hooks as observe
from txmq.protocol.message import (
    MessageExt,
    MessageQueue,
    clip_reason,
    is_system_topic,
    retry_topic,
)
from txmq.protocol.wire import (
    ConsumerData,
    ConsumerSendMsgBack,
    Empty,
    GetConsumerListByGroup,
    Heartbeat,
    NotifyConsumerIdsChanged,
    Request,
    ResetConsumerClientOffset,
    UnregisterClient,
)
from txmq.protocol.wire.base import Response
from txmq.protocol.wire.errors import TxmqError, UnsupportedRequest
from txmq.transports.port import Calls, Receiver, Receives

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


def _client_id(instance_name: str) -> str:
    return f"{socket.gethostname()}@{instance_name}"


def _seconds(name: str, given: float | None, default: float) -> float:
    """A positive number of seconds: ``given``, else ``$TXMQ_<NAME>_S``, else ``default``."""
    if given is None:
        variable = f"TXMQ_{name.upper()}_S"
        text = os.environ.get(variable, "").strip()
        try:
            given = float(text) if text else default
        except ValueError:
            raise ValueError(f"${variable} is {text!r}: give seconds, e.g. 0.5") from None
        name = f"${variable}"
    if not given > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {given!r}")
    return given


class PushConsumer(BrokerClient):
    """Consumes subscribed topics for ``group`` and calls the listener for each message.

    CLUSTERING (default): the group's members share the queues (allocation recomputed on
    start, every ``rebalance_interval`` seconds and when the broker announces a membership
    change); offsets live on the broker. BROADCASTING: every member gets every message;
    offsets live in a local file under ``offset_dir``. CONCURRENT (default) or ``orderly``:
    orderly holds a broker-side lock per queue and consumes it one message at a time.
    Consumed offsets are committed every ``persist_interval`` seconds (default
    ``$TXMQ_PERSIST_INTERVAL_S`` or 5) and at stop.

    ``transport="grpc"`` (see :mod:`txmq.client.core`): RocketMQ 5 has no pull; the consumer
    receives from the queues the endpoint assigns (:mod:`txmq.transports.grpc.receiving`), each
    message invisible to the group's other members for ``invisible_time`` seconds (renewed while its
    listener runs; default ``$TXMQ_INVISIBLE_TIME_S`` or 15: how soon the messages of a
    member that died come back).  The listener, its concurrency and results are the same.
    A new group starts where the endpoint starts it (``consume_from`` is the endpoint's);
    BROADCASTING and ``orderly`` (txmq queue locks) are txmq-protocol only: configure the
    group as FIFO on the endpoint for ordered delivery.
    """

    needs_full_protocol = False

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
        persist_interval: float | None = None,
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
        super().__init__(address, **kwargs)
        self.group = group
        if not self.carrier.full_protocol:
            if MessageModel(message_model) is MessageModel.BROADCASTING:
                raise UnsupportedRequest(
                    f"BROADCASTING over transport={self.transport!r}: RocketMQ 5's protocol "
                    "has no broadcasting consumption (use transport='txmq')"
                )
            if orderly:
                raise UnsupportedRequest(
                    f"orderly=True over transport={self.transport!r}: orderly consumption "
                    "holds txmq queue locks, which RocketMQ 5's protocol has not; make the "
                    "group FIFO on the endpoint instead (it then delivers a message group in "
                    "order)"
                )
        self.invisible_time = _seconds("invisible_time", invisible_time, 15.0)
        self.listener = listener
        self.message_model = MessageModel(message_model)
        self.orderly = orderly
        self.allocate = allocate
        self.consume_from = ConsumeFrom(consume_from)
        self.max_reconsume_times = max_reconsume_times
        self.pull_batch_size = pull_batch_size
        self.rebalance_interval = rebalance_interval
        self.heartbeat_interval = heartbeat_interval
        self.persist_interval = _seconds("persist_interval", persist_interval, 5.0)
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
        self.consume_concurrency = consume_concurrency
        self._limiter = anyio.CapacityLimiter(consume_concurrency)
        # a fixed pool of workers, fed by the pull loops (or the transport's receiver)
        self._work: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()
        self.puller = Puller(self, group)
        self.offsets: OffsetStore
        if self.message_model is MessageModel.BROADCASTING:
            base = Path(offset_dir) if offset_dir else Path.home() / ".txmq" / "offsets"
            self.offsets = LocalFileOffsetStore(base / self.instance_name / group / "offsets.json")
        else:
            self.offsets = RemoteOffsetStore(self.puller)
        #: consumption by pulling (None: the transport has no pulls; it receives)
        self.pulling = PullMode(self) if self.carrier.full_protocol else None
        self._receiver: Receiver | None = None

    @property
    def queues_held(self) -> dict[MessageQueue, ProcessQueue]:
        """The queues this member consumes, each with its messages in flight."""
        return self.pulling.held if self.pulling is not None else {}

    # -- configuration ---------------------------------------------------------------------

    def subscribe(self, topic: str, expression: str = "*") -> None:
        if is_system_topic(topic):
            raise ValueError(f"cannot subscribe to the system topic {topic!r}")
        self.subscriptions[topic] = expression or "*"

    def register_listener(self, listener: Listener) -> None:
        self.listener = listener

    def all_subscriptions(self) -> Mapping[str, str]:
        """The subscriptions, and (clustering) the group's retry topic."""
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
        await self.connect()
        await self._heartbeat()
        tg = self._task_group()
        tg.start_soon(self._heartbeat_loop)
        if self.pulling is None or not self.orderly:
            for _ in range(self.consume_concurrency):
                tg.start_soon(self._consume_worker)
        if self.pulling is not None:
            await self.pulling.start(tg)
            return
        remote = self.remote()
        if not isinstance(remote, Receives):
            raise UnsupportedRequest(
                f"transport {self.transport!r} can neither pull nor receive: no push consumer "
                "runs on it"
            )
        self._receiver = remote.receiver(self)
        self._receiver.start(tg)

    async def _on_stop(self) -> None:
        unregister = UnregisterClient(client_id=self.client_id, consumer_groups=[self.group])
        if self._receiver is not None:
            self._receiver.stop()
            with anyio.move_on_after(5):
                await self._unregister(unregister)
            return
        assert self.pulling is not None
        with anyio.move_on_after(5):
            await self.pulling.stop()
            await self._unregister(unregister)

    def serve(self, request: Request[Any], body: bytes, origin: Calls) -> Response | None:
        """The broker's notices: the group's members changed (rebalance now), an operator
        reset the group's offsets of a topic (:mod:`txmq.consumer.reset`)."""
        if isinstance(request, NotifyConsumerIdsChanged):
            if self.pulling is not None:
                self.pulling.rebalance_soon()
            return Empty()
        if isinstance(request, ResetConsumerClientOffset):
            pulling = self.pulling
            if request.group == self.group and pulling is not None and not pulling.stopping:
                self._task_group().start_soon(reset_queues, pulling, self.offsets, request)
            return Empty()
        return super().serve(request, body, origin)

    # -- heartbeats, rebalance -------------------------------------------------------------

    def _heartbeat_request(self) -> Heartbeat:
        consumer = ConsumerData(
            group=self.group,
            message_model="BROADCASTING"
            if self.message_model is MessageModel.BROADCASTING
            else "CLUSTERING",
            consume_type="ORDERLY" if self.orderly else "CONCURRENTLY",
            subscriptions=dict(self.all_subscriptions()),
        )
        return Heartbeat(client_id=self.client_id, consumers=[consumer])

    async def consumer_ids(self, broker_name: str | None = None) -> list[str]:
        """The group's members, as a broker of the group's topics knows them (every member
        heartbeats every broker of its subscriptions)."""
        request = GetConsumerListByGroup(group=self.group)
        return sorted((await self.call(request, broker=broker_name, replica="any")).client_ids)

    async def rebalance(self) -> None:
        """Recompute which queues this member consumes, and start or stop their pulls."""
        if self.pulling is not None:
            await self.pulling.rebalance()

    def routed(self, topic: str, found: bool) -> None:
        """Whether a subscribed topic has a route.  Says once (a WARNING; again only after it
        had a route) that a subscribed topic has none; its own retry topic, made on first
        use, only at DEBUG."""
        if found:
            self._unrouted.discard(topic)
            return
        if topic in self._unrouted or topic not in self.subscriptions:
            log.debug("topic %s has no route yet", topic)
            return
        self._unrouted.add(topic)
        log.warning(
            "topic %s has no route: no broker holds it (yet); group %s consumes it once one does",
            topic,
            self.group,
        )

    # -- consuming -------------------------------------------------------------------------

    def backlog(self) -> int:
        """How many messages wait for a consume worker."""
        return self._work.qsize()

    def submit(self, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``job`` (a message's consumption) on one of the consume workers."""
        self._work.put_nowait(job)

    async def _consume_worker(self) -> None:
        while True:
            job = await self._work.get()
            await job()

    async def invoke(self, msg: MessageExt) -> tuple[ConsumeResult, str]:
        """Run the listener on ``msg`` (every transport and consumption mode comes here:
        inside its ``process`` span, timed for the client metrics); its result, and why
        when it is not SUCCESS: a dead letter's reason, the listener's error ("" for a
        RECONSUME_LATER)."""
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
