"""Request handlers: send, batch send, pull with long polling, offsets, admin queries."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgpack

from txmq.broker.consumers import ClientGroupHandlers
from txmq.broker.locks import QueueLockHandlers
from txmq.broker.putting import MAX_PROPERTIES_SIZE, check_put, put_or_raise
from txmq.broker.retry import RetryHandlers
from txmq.broker.store import GetStatus, MessageTooLarge, PutResult
from txmq.codec import read_header
from txmq.errors import (
    BadRequest,
    FlushDiskTimeout,
    MessageNotFound,
    ResponseCode,
    TopicNotFound,
)
from txmq.errors import MessageTooLarge as MessageTooLargeError
from txmq.message import Prop, tag_hash
from txmq.protocol import Frame, RequestCode
from txmq.remoting import Connection, HandlerResult, Response

if TYPE_CHECKING:
    from txmq.broker.server import Broker

__all__ = ["RequestProcessor", "parse_subscription"]

log = logging.getLogger("txmq.broker")

_PULL_STATUS = {
    GetStatus.FOUND: "FOUND",
    GetStatus.NO_MATCHED_MESSAGE: "NO_MATCHED_MSG",
    GetStatus.OFFSET_FOUND_NULL: "NO_MATCHED_MSG",
    GetStatus.NO_MESSAGE_IN_QUEUE: "NO_NEW_MSG",
    GetStatus.OFFSET_OVERFLOW_ONE: "NO_NEW_MSG",
    GetStatus.NO_MATCHED_LOGIC_QUEUE: "NO_NEW_MSG",
    GetStatus.OFFSET_TOO_SMALL: "OFFSET_ILLEGAL",
    GetStatus.OFFSET_OVERFLOW_BADLY: "OFFSET_ILLEGAL",
}
_WAITABLE = {
    GetStatus.NO_MESSAGE_IN_QUEUE,
    GetStatus.OFFSET_OVERFLOW_ONE,
    GetStatus.NO_MATCHED_LOGIC_QUEUE,
}
MAX_PULL_BATCH = 1024


def parse_subscription(expression: object) -> set[int] | None:
    """Tag codes for ``"tagA || tagB"``; ``None`` for ``"*"`` (everything)."""
    if expression is None:
        return None
    if not isinstance(expression, str):
        raise BadRequest("subscription expression must be a string")
    expression = expression.strip()
    if expression in ("", "*"):
        return None
    tags = [t.strip() for t in expression.split("||")]
    if any(not t for t in tags):
        raise BadRequest(f"subscription expression {expression!r} has an empty tag")
    return {tag_hash(t) for t in tags}


def _field(header: dict[str, Any], name: str, kind: type, default: Any = ...) -> Any:
    value = header.get(name, default)
    if value is ...:
        raise BadRequest(f"request header misses {name!r}")
    if value is not None and value is not default and not isinstance(value, kind):
        raise BadRequest(f"request header field {name!r} must be {kind.__name__}")
    if kind is int and isinstance(value, bool):
        raise BadRequest(f"request header field {name!r} must be int")
    return value


def _properties(raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise BadRequest("message properties must map strings to strings")
    return raw


class RequestProcessor:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.store = broker.store
        self.topics = broker.topics
        self.offsets = broker.offsets
        self.config = broker.config
        self._handlers: dict[int, Callable[[Connection, Frame], HandlerResult]] = {
            RequestCode.SEND_MESSAGE: self.send_message,
            RequestCode.SEND_BATCH_MESSAGE: self.send_batch,
            RequestCode.PULL_MESSAGE: self.pull_message,
            RequestCode.UPDATE_CONSUMER_OFFSET: self.update_offset,
            RequestCode.QUERY_CONSUMER_OFFSET: self.query_offset,
            RequestCode.GET_ROUTE_INFO: self.route_info,
            RequestCode.UPDATE_AND_CREATE_TOPIC: self.create_topic,
            RequestCode.DELETE_TOPIC: self.delete_topic,
            RequestCode.GET_ALL_TOPIC_CONFIG: self.all_topics,
            RequestCode.GET_TOPIC_STATS: self.topic_stats,
            RequestCode.GET_MAX_OFFSET: self.max_offset,
            RequestCode.GET_MIN_OFFSET: self.min_offset,
            RequestCode.VIEW_MESSAGE_BY_ID: self.view_message,
            RequestCode.QUERY_MESSAGE_BY_KEY: self.query_by_key,
            RequestCode.GET_ALL_CONSUMER_OFFSETS: self.all_offsets,
            RequestCode.GET_BROKER_RUNTIME_INFO: self.runtime_info,
        }
        # groups, queue locks, retries, the DLQ and transactions live in their own modules
        self.schedule = broker.schedule
        for extra in (
            ClientGroupHandlers(broker),
            QueueLockHandlers(broker),
            RetryHandlers(broker),
            broker.transactions,
            broker.transaction_checker,
        ):
            self._handlers.update(extra.handlers())

    def handle(self, conn: Connection, frame: Frame) -> HandlerResult:
        handler = self._handlers.get(frame.code)
        if handler is None:
            return (
                ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                {"error": f"request code {frame.code} is not supported by this broker"},
                b"",
            )
        return handler(conn, frame)

    # -- sending ----------------------------------------------------------------------------

    def _check_body(self, size: int) -> None:
        limit = self.config.max_message_size
        if size > limit:
            raise MessageTooLargeError(
                f"message body of {size} bytes is over the limit of {limit} bytes"
            )

    def _target(self, header: dict[str, Any]) -> tuple[str, int]:
        topic = _field(header, "topic", str)
        queue_id = _field(header, "queue_id", int)
        cfg = self.topics.for_send(topic)
        if not 0 <= queue_id < cfg.queue_nums:
            raise BadRequest(
                f"queue id {queue_id} is out of range for topic {topic!r} ({cfg.queue_nums} queues)"
            )
        return topic, queue_id

    def _acked(self, end_offset: int, response: Response) -> HandlerResult:
        """The answer, at once (ASYNC flush) or once fsynced (SYNC flush: group commit)."""
        if self.config.flush.value != "sync":
            return response
        flushed = self.store.flush_future(end_offset)
        if flushed is None:
            return response
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Response | None] = loop.create_future()
        limit = self.config.sync_flush_timeout_s

        def on_flushed(f: asyncio.Future[None]) -> None:
            expiry.cancel()
            if answer.done():
                return
            if f.cancelled() or f.exception() is not None:
                answer.set_exception(FlushDiskTimeout(f"flush failed: {f.exception()}"))
            else:
                answer.set_result(response)

        def on_timeout() -> None:
            if not answer.done():
                answer.set_exception(
                    FlushDiskTimeout(f"message stored but not flushed within {limit}s")
                )

        expiry = loop.call_later(limit, on_timeout)
        flushed.add_done_callback(on_flushed)
        return answer

    def send_message(self, conn: Connection, frame: Frame) -> HandlerResult:
        h = frame.header
        self._check_body(len(frame.body))
        topic, queue_id = self._target(h)
        props = _properties(h.get("properties"))
        if props.get(Prop.TRAN_MSG, "").lower() == "true":  # a half message: broker/transaction.py
            return self.broker.transactions.prepare(h, frame.body, topic, queue_id, props)
        # a delayed message goes to the schedule topic (broker/schedule.py) first
        delayed = self.schedule.prepare(topic, queue_id, props) if Prop.DELAY in props else None
        r = put_or_raise(
            self.store,
            topic=topic if delayed is None else delayed[0],
            queue_id=queue_id if delayed is None else delayed[1],
            body=frame.body,
            properties=props if delayed is None else delayed[2],
            born_timestamp=_field(h, "born_timestamp", int, 0) or _now_ms(),
            flag=_field(h, "flag", int, 0),
            cq_tag_code=None if delayed is None else delayed[3],
        )
        if delayed is None:
            self.broker.notify_arrival(topic, queue_id)
        else:
            self.schedule.stored(delayed[4], delayed[3])
        return self._acked(
            r.end_offset, (ResponseCode.SUCCESS, _send_answer(props, queue_id, r), b"")
        )

    def send_batch(self, conn: Connection, frame: Frame) -> HandlerResult:
        h = frame.header
        topic, queue_id = self._target(h)
        entries = _field(h, "messages", list)
        if not entries:
            raise BadRequest("a batch needs at least one message")
        items: list[dict[str, Any]] = []
        delays: list[tuple[int, int]] = []
        pos = 0
        body = frame.body
        now = _now_ms()
        for entry in entries:
            if not isinstance(entry, dict):
                raise BadRequest("batch entries must be maps")
            size = _field(entry, "size", int)
            if size < 0 or pos + size > len(body):
                raise BadRequest("batch entry sizes do not match the frame body")
            self._check_body(size)
            _check_properties_size(entry.get("properties"))
            items.append(
                {
                    "topic": topic,
                    "queue_id": queue_id,
                    "body": body[pos : pos + size],
                    "properties": _properties(entry.get("properties")),
                    "born_timestamp": _field(entry, "born_timestamp", int, 0) or now,
                }
            )
            if items[-1]["properties"].get(Prop.TRAN_MSG, "").lower() == "true":
                raise BadRequest("a batch cannot hold transactional (half) messages")
            if Prop.DELAY in items[-1]["properties"]:
                self._delay_item(items[-1], delays)
            pos += size
        if pos != len(body):
            raise BadRequest("batch entry sizes do not add up to the frame body")
        try:
            results = self.store.put_batch(items)
        except MessageTooLarge as exc:
            raise MessageTooLargeError(str(exc)) from None
        for r in results:
            check_put(r)
        if len(delays) < len(items):
            self.broker.notify_arrival(topic, queue_id)
        for level, due in delays:
            self.schedule.stored(level, due)
        first = results[0]
        answer = {
            "msg_ids": [it["properties"].get(Prop.UNIQ_KEY, "") for it in items],
            "offset_msg_ids": [f"{r.commit_log_offset:016X}" for r in results],
            "queue_id": queue_id,
            "queue_offset": first.queue_offset,
            "store_timestamp": first.store_timestamp,
        }
        return self._acked(results[-1].end_offset, (ResponseCode.SUCCESS, answer, b""))

    def _delay_item(self, item: dict[str, Any], delays: list[tuple[int, int]]) -> None:
        delayed = self.schedule.prepare(item["topic"], item["queue_id"], item["properties"])
        if delayed is not None:
            topic, queue_id, props, due, level = delayed
            item.update(topic=topic, queue_id=queue_id, properties=props, cq_tag_code=due)
            delays.append((level, due))

    # -- pulling ----------------------------------------------------------------------------

    def pull_message(self, conn: Connection, frame: Frame) -> HandlerResult:
        h = frame.header
        topic = _field(h, "topic", str)
        queue_id = _field(h, "queue_id", int)
        offset = _field(h, "offset", int)
        max_msgs = min(max(_field(h, "max_msgs", int, 32), 1), MAX_PULL_BATCH)
        suspend_ms = _field(h, "suspend_ms", int, 0)
        tag_codes = parse_subscription(h.get("subscription"))
        if self.topics.get(topic) is None:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        result = self.store.get_messages(topic, queue_id, offset, max_msgs, tag_codes=tag_codes)
        if result.status in _WAITABLE and suspend_ms > 0:
            # registered now: the coroutine below starts a loop iteration later (remoting
            # runs it as a task), and a message stored meanwhile must still wake it
            arrival = self.broker.arrival(topic, queue_id)
            return self._long_poll(
                topic, queue_id, offset, max_msgs, tag_codes, suspend_ms, arrival
            )
        return _pull_answer(result)

    async def _long_poll(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_msgs: int,
        tag_codes: set[int] | None,
        suspend_ms: int,
        arrival: anyio.Event,
    ) -> Response:
        deadline = time.monotonic() + min(suspend_ms / 1000, self.config.long_polling_max_s)
        while True:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                with anyio.move_on_after(remaining):
                    await arrival.wait()
            result = self.store.get_messages(topic, queue_id, offset, max_msgs, tag_codes=tag_codes)
            if result.status not in _WAITABLE or remaining <= 0:
                return _pull_answer(result)
            arrival = self.broker.arrival(topic, queue_id)  # same step as the empty read

    # -- offsets ----------------------------------------------------------------------------

    def update_offset(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        self.offsets.commit(
            _field(h, "group", str),
            _field(h, "topic", str),
            _field(h, "queue_id", int),
            _field(h, "offset", int),
        )
        return (ResponseCode.SUCCESS, None, b"")

    def query_offset(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        offset = self.offsets.query(
            _field(h, "group", str), _field(h, "topic", str), _field(h, "queue_id", int)
        )
        return (ResponseCode.SUCCESS, {"offset": offset}, b"")

    def all_offsets(self, conn: Connection, frame: Frame) -> Response:
        rows = []
        for group, topics in sorted(self.offsets.snapshot().items()):
            for topic, queues in sorted(topics.items()):
                for queue_id, offset in sorted(queues.items()):
                    max_offset = self.store.max_offset(topic, queue_id)
                    rows.append(
                        {
                            "group": group,
                            "topic": topic,
                            "queue_id": queue_id,
                            "offset": offset,
                            "max_offset": max_offset,
                            "lag": max(max_offset - offset, 0),
                        }
                    )
        return (ResponseCode.SUCCESS, {"offsets": rows}, b"")

    def max_offset(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        off = self.store.max_offset(_field(h, "topic", str), _field(h, "queue_id", int))
        return (ResponseCode.SUCCESS, {"offset": off}, b"")

    def min_offset(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        off = self.store.min_offset(_field(h, "topic", str), _field(h, "queue_id", int))
        return (ResponseCode.SUCCESS, {"offset": off}, b"")

    # -- topics -----------------------------------------------------------------------------

    def route_info(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        topic = _field(h, "topic", str)
        if _field(h, "create", bool, False):
            cfg = self.topics.for_send(topic)
        else:
            found = self.topics.get(topic)
            if found is None:
                raise TopicNotFound(f"topic {topic!r} does not exist")
            cfg = found
        return (ResponseCode.SUCCESS, {"topic": cfg.name, "queue_nums": cfg.queue_nums}, b"")

    def create_topic(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        cfg = self.topics.create_or_update(
            _field(h, "topic", str), _field(h, "queue_nums", int, self.config.default_queue_nums)
        )
        log.info("topic %s now has %d queues", cfg.name, cfg.queue_nums)
        return (ResponseCode.SUCCESS, {"topic": cfg.name, "queue_nums": cfg.queue_nums}, b"")

    def delete_topic(self, conn: Connection, frame: Frame) -> Response:
        topic = _field(frame.header, "topic", str)
        self.topics.check_name(topic)
        if not self.topics.delete(topic):
            raise TopicNotFound(f"topic {topic!r} does not exist")
        self.offsets.remove_topic(topic)
        return (ResponseCode.SUCCESS, None, b"")

    def all_topics(self, conn: Connection, frame: Frame) -> Response:
        stats = self.store.queue_offsets()
        rows = []
        for cfg in self.topics.all():
            queues = stats.get(cfg.name, {})
            rows.append(
                {
                    "topic": cfg.name,
                    "queue_nums": cfg.queue_nums,
                    "system": cfg.system,
                    "messages": sum(mx - mn for mn, mx in queues.values()),
                    "max_offset_total": sum(mx for _, mx in queues.values()),
                }
            )
        return (ResponseCode.SUCCESS, {"topics": rows}, b"")

    def topic_stats(self, conn: Connection, frame: Frame) -> Response:
        topic = _field(frame.header, "topic", str)
        cfg = self.topics.get(topic)
        if cfg is None:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        rows = []
        for queue_id in range(cfg.queue_nums):
            mn = self.store.min_offset(topic, queue_id)
            mx = self.store.max_offset(topic, queue_id)
            last = 0
            if mx > mn:
                got = self.store.get_messages(topic, queue_id, mx - 1, 1)
                if got.records:
                    last = read_header(got.records[0]).store_timestamp
            rows.append(
                {"queue_id": queue_id, "min_offset": mn, "max_offset": mx, "last_store_ts": last}
            )
        return (ResponseCode.SUCCESS, {"topic": topic, "queues": rows}, b"")

    # -- messages ---------------------------------------------------------------------------

    def view_message(self, conn: Connection, frame: Frame) -> Response:
        msg_id = _field(frame.header, "msg_id", str)
        record = self.store.query_by_uniq_key(msg_id)
        if record is None and len(msg_id) == 16:
            try:
                record = self.store.look_message_by_offset(int(msg_id, 16))
            except ValueError:
                record = None
        if record is None:
            raise MessageNotFound(f"no message with id {msg_id!r}")
        return (ResponseCode.SUCCESS, None, record)

    def query_by_key(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        key = _field(h, "key", str)
        records = self.store.query_by_key(key, max_num=min(_field(h, "max_num", int, 32), 1000))
        if not records:
            raise MessageNotFound(f"no message with key {key!r}")
        return (ResponseCode.SUCCESS, {"count": len(records)}, b"".join(records))

    # -- broker -----------------------------------------------------------------------------

    def runtime_info(self, conn: Connection, frame: Frame) -> Response:
        return (ResponseCode.SUCCESS, self.broker.runtime_info(), b"")


def _check_properties_size(props: object) -> None:
    if props and len(msgpack.packb(props)) > MAX_PROPERTIES_SIZE:
        raise BadRequest(f"message properties are over {MAX_PROPERTIES_SIZE} bytes encoded")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _send_answer(props: dict[str, str], queue_id: int, r: PutResult) -> dict[str, Any]:
    return {
        "msg_id": props.get(Prop.UNIQ_KEY, ""),
        "offset_msg_id": f"{r.commit_log_offset:016X}",
        "queue_id": queue_id,
        "queue_offset": r.queue_offset,
        "store_timestamp": r.store_timestamp,
    }


def _pull_answer(result: Any) -> Response:
    header = {
        "status": _PULL_STATUS[result.status],
        "next_offset": result.next_begin_offset,
        "min_offset": result.min_offset,
        "max_offset": result.max_offset,
    }
    return (ResponseCode.SUCCESS, header, b"".join(result.records))
