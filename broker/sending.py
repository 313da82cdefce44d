"""SEND_MESSAGE and SEND_BATCH_MESSAGE: store messages (half messages go to the transaction
service, delayed ones through the schedule topic) and acknowledge them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack

from txmq.broker.context import BrokerContext
from txmq.broker.putting import check_put, put_or_raise
from txmq.broker.schedule import Delayed, ScheduleMessageService
from txmq.broker.store import MAX_PROPERTIES_SIZE, PutResult
from txmq.broker.topics import check_queue_id
from txmq.broker.transaction import TransactionService
from txmq.errors import BadRequest, MessageTooLarge
from txmq.message import Prop
from txmq.rpc import Call
from txmq.wire import BatchResult, SendBatchMessage, SendMessage, Sent

__all__ = ["MAX_DELIVER_AHEAD_MS", "SendService", "sent"]

#: how far ahead a delivery time may be (RocketMQ 5's timerMaxDelaySec: 3 days)
MAX_DELIVER_AHEAD_MS = 3 * 86_400_000


def sent(props: dict[str, str], queue_id: int, r: PutResult) -> Sent:
    """The answer to a stored message."""
    return Sent(
        msg_id=props.get(Prop.UNIQ_KEY, ""),
        offset_msg_id=f"{r.commit_log_offset:016X}",
        queue_id=queue_id,
        queue_offset=r.queue_offset,
        store_timestamp=r.store_timestamp,
    )


class SendService:
    def __init__(
        self,
        ctx: BrokerContext,
        schedule: ScheduleMessageService,
        transactions: TransactionService,
    ) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.schedule = schedule
        self.transactions = transactions

    def _check_body(self, size: int) -> None:
        limit = self.ctx.config.max_message_size
        if size > limit:
            raise MessageTooLarge(
                f"message body of {size} bytes is over the limit of {limit} bytes"
            )

    def _check_queue(self, topic: str, queue_id: int) -> None:
        check_queue_id(self.ctx.topics.for_send(topic), queue_id)

    def send_message(self, req: SendMessage, call: Call) -> Sent | asyncio.Future[Sent]:
        return self.put(req, call.body)

    def put(self, req: SendMessage, body: bytes) -> Sent | asyncio.Future[Sent]:
        """Store one message (the gRPC endpoint's SendMessage comes here too)."""
        self._check_body(len(body))
        self._check_queue(req.topic, req.queue_id)
        props = req.properties
        if props.get(Prop.TRAN_MSG, "").lower() == "true":  # a half message
            return self.transactions.prepare(req, body)
        topic, queue_id = req.topic, req.queue_id
        # a delayed message goes to the schedule topic (broker/schedule.py) first
        delayed = self._delayed(topic, queue_id, props)
        r = put_or_raise(
            self.store,
            topic=topic if delayed is None else delayed[0],
            queue_id=queue_id if delayed is None else delayed[1],
            body=body,
            properties=props if delayed is None else delayed[2],
            born_timestamp=req.born_timestamp or _now_ms(),
            flag=req.flag,
            cq_tag_code=None if delayed is None else delayed[3],
        )
        if delayed is None:
            self.ctx.arrivals.notify(topic, queue_id)
        else:
            self.schedule.stored(delayed[4], delayed[3])
        self.ctx.throughput.put += 1
        tally = self.ctx.throughput.tally
        if tally is not None:
            tally.stored(topic, _kind(props, delayed is not None), len(body))
        return self.ctx.acks.after_flush(r.end_offset, sent(props, queue_id, r))

    def send_batch(
        self, req: SendBatchMessage, call: Call
    ) -> BatchResult | asyncio.Future[BatchResult]:
        topic, queue_id = req.topic, req.queue_id
        self._check_queue(topic, queue_id)
        if not req.messages:
            raise BadRequest("a batch needs at least one message")
        items: list[dict[str, Any]] = []
        delays: list[tuple[int, int]] = []
        pos = 0
        body = call.body
        now = _now_ms()
        for entry in req.messages:
            size = entry.size
            if size < 0 or pos + size > len(body):
                raise BadRequest("batch entry sizes do not match the frame body")
            self._check_body(size)
            props = entry.properties
            if props and len(msgpack.packb(props)) > MAX_PROPERTIES_SIZE:
                raise BadRequest(f"message properties are over {MAX_PROPERTIES_SIZE} bytes encoded")
            if props.get(Prop.TRAN_MSG, "").lower() == "true":
                raise BadRequest("a batch cannot hold transactional (half) messages")
            item: dict[str, Any] = {
                "topic": topic,
                "queue_id": queue_id,
                "body": body[pos : pos + size],
                "properties": props,
                "born_timestamp": entry.born_timestamp or now,
            }
            if Prop.DELAY in props or Prop.DELIVER_AT in props:
                self._delay(item, delays)
            items.append(item)
            pos += size
        if pos != len(body):
            raise BadRequest("batch entry sizes do not add up to the frame body")
        results = [check_put(r) for r in self.store.put_batch(items)]
        self.ctx.throughput.put += len(results)
        tally = self.ctx.throughput.tally
        if tally is not None:
            for it in items:
                kind = _kind(it["properties"], "cq_tag_code" in it)
                tally.stored(topic, kind, len(it["body"]))
        if len(delays) < len(items):
            self.ctx.arrivals.notify(topic, queue_id)
        for level, due in delays:
            self.schedule.stored(level, due)
        first = results[0]
        answer = BatchResult(
            msg_ids=[it["properties"].get(Prop.UNIQ_KEY, "") for it in items],
            offset_msg_ids=[f"{r.commit_log_offset:016X}" for r in results],
            queue_id=queue_id,
            queue_offset=first.queue_offset,
            store_timestamp=first.store_timestamp,
        )
        return self.ctx.acks.after_flush(results[-1].end_offset, answer)

    def _delayed(self, topic: str, queue_id: int, props: dict[str, str]) -> Delayed | None:
        if Prop.DELIVER_AT in props:
            raw = props[Prop.DELIVER_AT]
            try:
                at = int(raw)
            except ValueError:
                raise BadRequest(f"{Prop.DELIVER_AT} {raw!r} is not a time in ms") from None
            limit = _now_ms() + MAX_DELIVER_AHEAD_MS
            if at > limit:
                raise BadRequest(
                    f"delivery time {at} is more than {MAX_DELIVER_AHEAD_MS // 86_400_000} days "
                    "ahead"
                )
            return self.schedule.prepare_at(topic, queue_id, props, at)
        if Prop.DELAY in props:
            return self.schedule.prepare(topic, queue_id, props)
        return None

    def _delay(self, item: dict[str, Any], delays: list[tuple[int, int]]) -> None:
        delayed = self._delayed(item["topic"], item["queue_id"], item["properties"])
        if delayed is not None:
            topic, queue_id, props, due, level = delayed
            item.update(topic=topic, queue_id=queue_id, properties=props, cq_tag_code=due)
            delays.append((level, due))


def _kind(props: dict[str, str], delayed: bool) -> str:
    """RocketMQ 5's message_type label of a stored message."""
    if delayed:
        return "delay"
    return "fifo" if Prop.SHARDING_KEY in props else "normal"


def _now_ms() -> int:
    return int(time.time() * 1000)
