"""The producer: sync send with retries, async send, oneway, batch; queue selection."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from txmq.client import BrokerClient
from txmq.errors import InvalidTopic, MessageTooLarge, TxmqError
from txmq.message import Message, Prop, is_system_topic, new_message_id, stable_hash
from txmq.message import validate_topic_name as _why_bad_topic
from txmq.wire import BatchEntry, SendBatchMessage, SendMessage, Sent

__all__ = [
    "MessageQueueSelector",
    "Producer",
    "QueueOptions",
    "SendCallback",
    "SendOptions",
    "SendResult",
    "check_message",
    "select_by_hash",
    "send_result",
]

log = logging.getLogger("txmq.producer")

MessageQueueSelector = Callable[[int, Message, Any], int]
"""``selector(queue_count, message, arg) -> queue id``."""

SendCallback = Callable[["SendResult | None", "BaseException | None"], None]


class QueueOptions(TypedDict, total=False):
    """Where a message goes and how long its send may take (keyword arguments of every
    send: ``producer.send(msg, sharding_key="42")``).

    The queue: ``queue_id`` if given; else ``stable_hash(sharding_key) % queues`` (the
    same in every process: messages with one key stay in order); else
    ``selector(queues, msg, arg)``; else round robin (and a failed send may move to the
    next queue).  ``timeout``: seconds to wait for the broker's answer (default: the
    producer's ``send_timeout``).
    """

    sharding_key: str | None
    selector: MessageQueueSelector | None
    queue_id: int | None
    timeout: float | None


class SendOptions(QueueOptions, total=False):
    """:class:`QueueOptions` and ``arg``, the selector's third argument."""

    arg: Any

DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024


def select_by_hash(queue_nums: int, message: Message, key: Any) -> int:
    """The sharding-key selector: ``stable_hash(key) % queue_nums`` (same in every process)."""
    return stable_hash(str(key)) % queue_nums


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


def send_result(topic: str, sent: Sent) -> SendResult:
    """The result of a send from the broker's answer."""
    return SendResult(
        "SEND_OK",
        sent.msg_id,
        sent.offset_msg_id,
        topic,
        sent.queue_id,
        sent.queue_offset,
        sent.store_timestamp,
        transaction_offset=sent.transaction_offset,
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
            f"message body of {len(msg.body)} bytes is over the limit of "
            f"{max_message_size} bytes"
        )


class Producer(BrokerClient):
    """Sends messages to a broker.

    ``send`` waits for the broker's acknowledgement and, when the queue was picked round
    robin, retries a retriable failure on the next queue (``retry_times`` more attempts).
    A send with a sharding key or a selector always goes to that queue and is not moved.
    """

    def __init__(
        self,
        address: str | None = None,
        group: str = "DEFAULT_PRODUCER",
        *,
        send_timeout: float = 3.0,
        retry_times: int = 2,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        **kwargs: Any,
    ) -> None:
        super().__init__(address, request_timeout=send_timeout, **kwargs)
        self.group = group
        self.retry_times = retry_times
        self.max_message_size = max_message_size
        self._round_robin = itertools.count()

    # -- validation ------------------------------------------------------------------------

    def _check(self, msg: Message) -> None:
        check_message(msg, self.max_message_size)

    async def _pick(self, msg: Message, options: QueueOptions) -> tuple[int, bool]:
        """(queue id, may move to another queue on failure)."""
        queue_id = options.get("queue_id")
        if queue_id is not None:
            return queue_id, False
        nums = await self.queue_nums(msg.topic, create=True)
        sharding_key = options.get("sharding_key")
        if sharding_key is not None:
            return select_by_hash(nums, msg, sharding_key), False
        selector = options.get("selector")
        if selector is not None:
            chosen = selector(nums, msg, options.get("arg"))
            if not isinstance(chosen, int) or not 0 <= chosen < nums:
                raise ValueError(f"selector returned {chosen!r}; expected 0..{nums - 1}")
            return chosen, False
        return next(self._round_robin) % nums, True

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
        qid, movable = await self._pick(msg, options)
        attempts = 1 + (self.retry_times if movable else 0)
        born = int(time.time() * 1000)
        timeout = options.get("timeout")
        for attempt in range(attempts):
            request = self._send_request(msg.topic, qid, props, born)
            try:
                sent = await self.call(request, body, timeout=timeout)
            except TxmqError as exc:
                if not exc.retriable or attempt + 1 >= attempts:
                    raise
                log.warning(
                    "send to %s/%d failed (%s); retrying on the next queue", msg.topic, qid, exc
                )
                nums = await self.queue_nums(msg.topic, create=True)
                qid = next(self._round_robin) % nums
                continue
            return send_result(msg.topic, sent)
        raise AssertionError("unreachable")  # pragma: no cover

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
        qid, _ = await self._pick(msg, options)
        request = self._send_request(msg.topic, qid, props)
        await self.remoting.send_oneway(request, bytes(msg.body))

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
        if len(body) + 65536 > self.remoting.max_frame_size:
            raise MessageTooLarge(
                f"batch of {len(body)} bytes is over the frame limit; split it into smaller batches"
            )
        qid, _ = await self._pick(msgs[0], options)
        request = SendBatchMessage(topic=topic, queue_id=qid, messages=entries, group=self.group)
        sent = await self.call(request, body, timeout=options.get("timeout"))
        return SendResult(
            "SEND_OK",
            sent.msg_ids[0],
            sent.offset_msg_ids[0],
            topic,
            sent.queue_id,
            sent.queue_offset,
            sent.store_timestamp,
            list(sent.msg_ids),
        )
