"""The producer: sync send with retries, async send, oneway, batch; queue selection."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from txmq.client.core import BrokerClient
from txmq.client.route import STALL_AFTER_S
from txmq.observability import hooks as observe
from txmq.protocol.message import (
    Message,
    MessageQueue,
    Prop,
    is_system_topic,
    new_message_id,
    stable_hash,
)
from txmq.protocol.message import validate_topic_name as _why_bad_topic
from txmq.protocol.wire import BatchEntry, RecallMessage, SendBatchMessage, SendMessage, Sent
from txmq.protocol.wire.errors import (
    BrokerUnavailable,
    FlushSlaveTimeout,
    InvalidTopic,
    MessageNotFound,
    MessageTooLarge,
    SlaveNotAvailable,
    TxmqError,
    UnsupportedRequest,
)

__all__ = [
    "MessageQueueSelector",
    "Producer",
    "QueueOptions",
    "SendCallback",
    "SendOptions",
    "SendResult",
    "check_message",
    "not_yet_safe",
    "select_by_hash",
    "send_result",
]

log = logging.getLogger("txmq.producer")

MessageQueueSelector = Callable[[int, Message, Any], int]
"""``selector(queue_count, message, arg) -> index``: of the topic's write queues over every
broker set (broker name, then queue id), as a broker alone: its queue id."""

SendCallback = Callable[["SendResult | None", "BaseException | None"], None]


class QueueOptions(TypedDict, total=False):
    """Where a message goes and how long its send may take (keyword arguments of every
    send: ``producer.send(msg, sharding_key="42")``).

    The queue: ``queue_id`` (of broker set ``broker_name``; needed on a cluster of several)
    if given; else ``stable_hash(sharding_key) % queues`` over every write queue of the
    topic (the same in every process: messages with one key stay in order while the route
    does not change); else ``selector(queues, msg, arg)``; else round robin, steering
    around broker sets that failed or were slow (and a failed send moves to another broker
    set).  ``timeout``: seconds to wait for the broker's answer (default: the producer's
    ``send_timeout``).
    """

    sharding_key: str | None
    selector: MessageQueueSelector | None
    queue_id: int | None
    broker_name: str | None
    timeout: float | None


class SendOptions(QueueOptions, total=False):
    """:class:`QueueOptions` and ``arg``, the selector's third argument."""

    arg: Any


DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024


def select_by_hash(queue_nums: int, message: Message, key: Any) -> int:
    """The sharding-key selector: ``stable_hash(key) % queue_nums`` (same in every process)."""
    return stable_hash(str(key)) % queue_nums


#: the status of a message stored and, under SYNC_MASTER, copied to a slave; the others:
#: FLUSH_SLAVE_TIMEOUT, SLAVE_NOT_AVAILABLE (stored on the master only)
SEND_OK = "SEND_OK"


@dataclass(frozen=True, slots=True)
class SendResult:
    status: str
    msg_id: str
    offset_msg_id: str
    topic: str
    queue_id: int
    queue_offset: int
    store_timestamp: int
    msg_ids: list[str] = field(default_factory=list)
    #: commit-log offset of a half message (transactional send), else -1
    transaction_offset: int = -1
    #: the broker set that stored it
    broker_name: str = ""


def send_result(topic: str, sent: Sent, broker_name: str = "") -> SendResult:
    """The result of a send from the broker's answer."""
    return SendResult(
        sent.status or SEND_OK,
        sent.msg_id,
        sent.offset_msg_id,
        topic,
        sent.queue_id,
        sent.queue_offset,
        sent.store_timestamp,
        transaction_offset=sent.transaction_offset,
        broker_name=broker_name,
    )


def not_yet_safe(result: SendResult) -> TxmqError | None:
    """For a result whose message is stored but not yet on a slave (FLUSH_SLAVE_TIMEOUT,
    SLAVE_NOT_AVAILABLE from a SYNC_MASTER), the error that says so; else None."""
    if result.status == SEND_OK:
        return None
    if result.status == "SLAVE_NOT_AVAILABLE":
        return SlaveNotAvailable(
            f"message {result.msg_id} is stored on broker set {result.broker_name or '?'}'s "
            "master, but no slave is connected to copy it"
        )
    return FlushSlaveTimeout(
        f"message {result.msg_id} is stored on broker set {result.broker_name or '?'}'s "
        f"master, but no slave confirmed a copy in time ({result.status})"
    )


def check_message(msg: Message, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
    """Refuse, before anything is sent or stored, what the broker would refuse: a bad or
    reserved topic, a body that isn't bytes or is over ``max_message_size``."""
    why = _why_bad_topic(msg.topic)
    if why:
        raise InvalidTopic(why)
    if is_system_topic(msg.topic):
        raise InvalidTopic(f"topic {msg.topic!r} is a reserved system topic")
    if not isinstance(msg.body, bytes | bytearray | memoryview):
        raise TypeError("message body must be bytes")
    if len(msg.body) > max_message_size:
        raise MessageTooLarge(
            f"message body of {len(msg.body)} bytes is over the limit of {max_message_size} bytes"
        )


class Producer(BrokerClient):
    """Sends messages to a broker.

    ``send`` waits for the broker's acknowledgement and, when the queue was picked round
    robin, retries a retriable failure on another broker set (``retry_times`` more
    attempts).  A send with a selector always goes to that queue and is not moved.

    A sharding key hashes over the topic's write queues; ``sharding`` says which, and
    what happens when the key's broker set is down:

    - ``"route"`` (default, RocketMQ's): the queues of the current route.  While the
      key's broker set is down but still routed, its sends fail; once the route drops it
      (the name server notices, the producer refreshes) the key hashes over the queues
      left — it moves — and moves back when the set returns.
    - ``"strict"``: every queue this producer has seen for the topic: a key never moves
      off a lost broker set; its sends fail until the set is back (order over
      availability; a broker set added still moves keys).
    - ``"available"``: like ``"route"``, but a key whose broker set is left out or fails
      moves at once to the next available queue (availability over order).

    ``transport="grpc"`` (see :mod:`txmq.client.core`): the address is a RocketMQ 5 endpoint,
    which picks the queue itself — round robin, or by message group: a sharding key is sent
    as the message group, so a key's messages stay in one queue, in order.  A queue chosen
    by ``queue_id`` or ``selector`` cannot be asked for (UnsupportedRequest).  ``topics``:
    the topics it publishes, declared to the endpoint at start (over gRPC the endpoint sends
    the check-backs of a topic's half messages to the producers that declared it; topics
    sent to are declared at their first send).

    ``stall_check_s`` (0.5 s): a send whose master has not answered for this long has its
    route fetched again (every 0.25 s while it waits); once the route names another master
    of the set, or none (a failover), the send stops waiting and is retried like a failed
    one.  A paused or cut-off master answers nothing, and a new one is elected sooner than
    the send would time out.  ``None``: a send waits for its answer or its timeout.
    """

    needs_full_protocol = False

    def __init__(
        self,
        address: str | None = None,
        group: str = "DEFAULT_PRODUCER",
        *,
        send_timeout: float = 3.0,
        retry_times: int = 2,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        sharding: str = "route",
        topics: Sequence[str] = (),
        stall_check_s: float | None = STALL_AFTER_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(address, request_timeout=send_timeout, **kwargs)
        if stall_check_s is not None and stall_check_s <= 0:
            raise ValueError(f"stall_check_s must be positive or None, not {stall_check_s!r}")
        self.routes.stall_after_s = stall_check_s
        self.group = group
        self.topics = tuple(topics)
        self.retry_times = retry_times
        self.max_message_size = max_message_size
        if sharding not in ("route", "strict", "available"):
            raise ValueError(f"sharding must be 'route', 'strict' or 'available', not {sharding!r}")
        self.sharding = sharding
        self._round_robin = itertools.count()

    def _declared_topics(self) -> Sequence[str]:
        return self.topics

    async def _on_start(self) -> None:
        await super()._on_start()
        if self.routes.direct is None and self.routes.stall_after_s is not None:
            self._task_group().start_soon(self.routes.watch_stalls)

    # -- validation ------------------------------------------------------------------------

    def _check(self, msg: Message) -> None:
        check_message(msg, self.max_message_size)

    async def _pick(self, msg: Message, options: QueueOptions) -> tuple[MessageQueue, int | None]:
        """(queue, where a retry starts looking for another queue: None, it may not move)."""
        self._task_group()
        if not self.carrier.full_protocol and (
            options.get("queue_id") is not None or options.get("selector") is not None
        ):
            raise UnsupportedRequest(
                "choosing the queue (queue_id=, selector=) over transport='grpc': a RocketMQ 5 "
                "endpoint picks the queue itself (give a sharding_key to keep messages in one "
                "queue, in order)"
            )
        wait = options.get("timeout") or self.request_timeout
        route = await self.routes.writable(msg.topic, wait, create=True)
        queue_id = options.get("queue_id")
        if queue_id is not None:
            broker = options.get("broker_name")
            if broker is None:
                brokers = sorted({mq.broker_name for mq in route.write_queues})
                if len(brokers) > 1:
                    raise ValueError(
                        f"queue_id={queue_id} of which broker set? {msg.topic} is on "
                        f"{', '.join(brokers)}: give broker_name too"
                    )
                broker = brokers[0] if brokers else ""
            return MessageQueue(msg.topic, broker, queue_id), None
        queues = route.write_queues
        sharding_key = options.get("sharding_key")
        if sharding_key is not None and queues:
            if self.sharding == "strict":
                every = self.routes.seen_queues(route)
                mq = every[select_by_hash(len(every), msg, sharding_key)]
                if mq.broker_name not in route.masters:
                    raise BrokerUnavailable(
                        f"the queue of sharding key {sharding_key!r} is {mq}, on broker set "
                        f"{mq.broker_name}, which the route has lost; strict key order: the "
                        "send is not moved (sharding='route' or 'available' would move it)"
                    )
                return mq, None
            index = select_by_hash(len(queues), msg, sharding_key)
            if self.sharding == "route":
                return queues[index], None
            return self.routes.pick(route, index), index
        selector = options.get("selector")
        if selector is not None and queues:
            nums = len(queues)
            chosen = selector(nums, msg, options.get("arg"))
            if not isinstance(chosen, int) or not 0 <= chosen < nums:
                raise ValueError(f"selector returned {chosen!r}; expected 0..{nums - 1}")
            return queues[chosen], None
        index = next(self._round_robin)
        return self.routes.pick(route, index), index

    def _wire_properties(self, msg: Message, sharding_key: str | None) -> dict[str, str]:
        """Validate ``msg`` and give the properties it is stored with (a fresh message id)."""
        self._check(msg)
        props = msg.wire_properties(new_message_id())
        if sharding_key is not None:
            props[Prop.SHARDING_KEY] = str(sharding_key)
        return props

    def _send_request(
        self, topic: str, queue_id: int, props: dict[str, str], born: int | None = None
    ) -> SendMessage:
        return SendMessage(
            topic=topic,
            queue_id=queue_id,
            properties=props,
            born_timestamp=born or int(time.time() * 1000),
            group=self.group,
        )

    # -- sending ---------------------------------------------------------------------------

    async def send(self, msg: Message, **options: Unpack[SendOptions]) -> SendResult:
        """Send ``msg`` and wait for the broker's acknowledgement (see :class:`SendOptions`)."""
        props = self._wire_properties(msg, options.get("sharding_key"))
        body = bytes(msg.body)
        mq, index = await self._pick(msg, options)
        attempts = 1 + (self.retry_times if index is not None else 0)
        born = int(time.time() * 1000)
        timeout = options.get("timeout")
        with observe.sending(msg.topic, self.group, [props], len(body)) as obs:
            for attempt in range(attempts):
                request = self._send_request(msg.topic, mq.queue_id, props, born)
                try:
                    sent = await self._send_to(mq, request, body, timeout)
                except TxmqError as exc:
                    if not exc.retriable or attempt + 1 >= attempts:
                        raise
                    log.warning("send to %s failed (%s); retrying on another queue", mq, exc)
                    wait = timeout or self.request_timeout
                    route = await self.routes.writable(msg.topic, wait, create=True, refresh=True)
                    if options.get("sharding_key") is None:
                        index = next(self._round_robin)
                    mq = self.routes.pick(route, index or 0, avoid=mq.broker_name)
                    continue
                obs.sent(sent.queue_id, mq.broker_name)
                return send_result(msg.topic, sent, mq.broker_name)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _send_to(
        self, mq: MessageQueue, request: SendMessage, body: bytes, timeout: float | None
    ) -> Sent:
        """Send to the master of the queue's broker set, recording how long it took (or
        that it failed) for fault avoidance."""
        began = time.monotonic()
        try:
            if self.routes.direct is not None or self.routes.stall_after_s is None:
                sent = await self.call(request, body, timeout=timeout, broker=mq.broker_name)
            else:
                address = self.routes.address_of(mq.broker_name)
                waiting = self.routes.watch(mq, address)
                try:
                    sent = await self.call(request, body, timeout=timeout, broker=mq.broker_name)
                except asyncio.CancelledError:
                    if not waiting.stopped():
                        raise
                    raise BrokerUnavailable(
                        f"while the send to {address} waited, the route came to name another "
                        f"master of {mq.broker_name} (or none: a failover); send again"
                    ) from None
                finally:
                    self.routes.unwatch(waiting)
        except TxmqError as exc:
            if exc.retriable:
                took = (time.monotonic() - began) * 1000
                self.routes.faults.update(mq.broker_name, took, failed=True)
                self.routes.failed(mq, unreachable=not getattr(exc, "sent", True))
            raise
        self.routes.faults.update(mq.broker_name, (time.monotonic() - began) * 1000)
        return sent

    def send_async(
        self,
        msg: Message,
        callback: SendCallback | None = None,
        **options: Unpack[SendOptions],
    ) -> None:
        """Send in the background; ``callback(result, error)`` runs when the answer arrives."""
        tg = self._task_group()

        async def run() -> None:
            try:
                result = await self.send(msg, **options)
            except Exception as exc:
                if callback is None:
                    log.error("async send to %s failed: %s", msg.topic, exc)
                else:
                    callback(None, exc)
                return
            if callback is not None:
                callback(result, None)

        tg.start_soon(run)

    async def send_oneway(self, msg: Message, **options: Unpack[SendOptions]) -> None:
        """Send without waiting for an answer (no acknowledgement, no retry, no timeout)."""
        props = self._wire_properties(msg, options.get("sharding_key"))
        mq, _ = await self._pick(msg, options)
        body = bytes(msg.body)
        with observe.sending(msg.topic, self.group, [props], len(body)):
            request = self._send_request(msg.topic, mq.queue_id, props)
            await self.remote(mq.broker_name).send_oneway(request, body)

    async def recall(self, topic: str, msg_id: str, *, timeout: float | None = None) -> int:
        """Recall the timer message ``msg_id`` of ``topic`` (sent with ``deliver_at`` or
        ``delay``, in a transaction or not) before its delivery time: it is never
        delivered (RocketMQ 5's recall).  Returns when it would have been (ms since the
        epoch).  MessageNotFound: it was delivered (or recalled) already, or no broker set
        of the topic holds it."""
        route = await self.route(topic)
        request = RecallMessage(topic=topic, msg_id=msg_id, group=self.group)
        errors: list[MessageNotFound] = []
        for broker in sorted(route.masters):
            try:
                return (await self.call(request, broker=broker, timeout=timeout)).deliver_at_ms
            except MessageNotFound as exc:
                errors.append(exc)
        # the broker set that holds it says why it cannot be recalled; the others that they
        # do not hold it
        found = [e for e in errors if "on this broker" not in str(e)]
        raise (found or errors or [MessageNotFound(f"topic {topic} has no broker set")])[0]

    async def send_batch(
        self, msgs: Sequence[Message], **options: Unpack[SendOptions]
    ) -> SendResult:
        """Send messages of one topic to one queue in one request; stored contiguously
        (a selector is given the first message)."""
        if not msgs:
            raise ValueError("send_batch needs at least one message")
        sharding_key = options.get("sharding_key")
        topic = msgs[0].topic
        entries: list[BatchEntry] = []
        bodies: list[bytes] = []
        born = int(time.time() * 1000)
        for m in msgs:
            if m.topic != topic:
                raise ValueError("all messages of a batch must have the same topic")
            if m.delay_level:
                raise ValueError("a batch cannot hold delayed messages")
            self._check(m)
            props = m.wire_properties(new_message_id())
            if sharding_key is not None:
                props[Prop.SHARDING_KEY] = str(sharding_key)
            entries.append(BatchEntry(properties=props, size=len(m.body), born_timestamp=born))
            bodies.append(bytes(m.body))
        body = b"".join(bodies)
        if len(body) + 65536 > self.max_frame_size:
            raise MessageTooLarge(
                f"batch of {len(body)} bytes is over the frame limit; split it into smaller batches"
            )
        mq, _ = await self._pick(msgs[0], options)
        with observe.sending(topic, self.group, [e.properties for e in entries], len(body)) as obs:
            request = SendBatchMessage(
                topic=topic, queue_id=mq.queue_id, messages=entries, group=self.group
            )
            sent = await self.call(
                request, body, timeout=options.get("timeout"), broker=mq.broker_name
            )
            obs.sent(sent.queue_id, mq.broker_name)
        return SendResult(
            sent.status or SEND_OK,
            sent.msg_ids[0],
            sent.offset_msg_ids[0],
            topic,
            sent.queue_id,
            sent.queue_offset,
            sent.store_timestamp,
            list(sent.msg_ids),
            broker_name=mq.broker_name,
        )
