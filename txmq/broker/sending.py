"""SEND_MESSAGE and SEND_BATCH_MESSAGE: store messages (half messages go to the transaction
service, delayed ones through the schedule topic) and acknowledge them.  A send of a
message id stored moments ago (a producer's retry after a lost acknowledgement) is answered
with the original's result and stores nothing (:mod:`txmq.broker.state.dedupe`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import msgspec

from txmq.broker.delivery.schedule import Delayed, ScheduleMessageService
from txmq.broker.state.context import BrokerContext
from txmq.broker.state.dedupe import Original
from txmq.broker.state.putting import check_put, put_or_raise
from txmq.broker.state.topics import check_queue_id
from txmq.broker.store import MAX_PROPERTIES_SIZE, PutResult
from txmq.broker.transactions.service import TransactionService
from txmq.protocol.message import Prop
from txmq.protocol.rpc import Call
from txmq.protocol.wire import (
    BatchResult,
    Recalled,
    RecallMessage,
    SendBatchMessage,
    SendMessage,
    Sent,
)
from txmq.protocol.wire.errors import BadRequest, MessageTooLarge, NotMaster

__all__ = ["SendService", "sent"]


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

    def recall(self, req: RecallMessage, call: Call) -> Recalled | asyncio.Future[Recalled]:
        """Recall a timer message before it is due (answered once the recall is flushed)."""
        if not self.store.writable:
            raise NotMaster("this broker is not its broker set's master: recall at the master")
        due, r = self.schedule.timer.recall(req.topic, req.msg_id)
        answer = Recalled(msg_id=req.msg_id, deliver_at_ms=due)
        return self.ctx.acks.after_flush(r.end_offset, answer)

    def send_message(self, req: SendMessage, call: Call) -> Sent | asyncio.Future[Sent]:
        return self.put(req, call.body, call.user.name if call.user is not None else None)

    def put(
        self, req: SendMessage, body: bytes, user: str | None = None
    ) -> Sent | asyncio.Future[Sent]:
        """Store one message (the gRPC endpoint's SendMessage comes here too); ``user``:
        who sent it, under access control (a half message keeps it: only that user's
        producers are asked about it, and only that user ends it)."""
        self._check_body(len(body))
        self._check_queue(req.topic, req.queue_id)
        self.ctx.acks.check_may_store()
        props = req.properties
        half = props.get(Prop.TRAN_MSG, "").lower() == "true"
        if half and (user is not None or Prop.ACL_USER in props):
            props = {k: v for k, v in props.items() if k != Prop.ACL_USER}
            if user is not None:
                props[Prop.ACL_USER] = user
            req = msgspec.structs.replace(req, properties=props)
        dedupe = self.ctx.dedupe
        msg_id = props.get(Prop.UNIQ_KEY) if dedupe is not None else None
        if msg_id and self.store.writable:
            assert dedupe is not None
            original = dedupe.admit(self.store, msg_id, req.topic, half)
            if original is not None:  # a retry: answered as the first send was
                return self.ctx.acks.after_flush(original.end_offset, original.sent(msg_id))
        if half:  # a half message
            return self.transactions.prepare(req, body)
        topic, queue_id = req.topic, req.queue_id
        # a delayed message goes to the schedule topic (broker/delivery/schedule.py) first
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
        self.ctx.acks.check_may_store()
        items: list[dict[str, Any]] = []
        delays: list[tuple[int, int]] = []
        pos = 0
        body = call.body
        now = _now_ms()
        dedupe = self.ctx.dedupe if self.store.writable else None
        #: per entry, the stored original of a retried one (each entry is deduplicated)
        originals: list[Original | None] = []
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
            msg_id = props.get(Prop.UNIQ_KEY)
            original = (
                dedupe.admit(self.store, msg_id, topic, False)
                if dedupe is not None and msg_id
                else None
            )
            originals.append(original)
            if original is not None:  # a retry of this entry: stored already
                pos += size
                continue
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
        if not items:  # every entry a retry
            return self._batch_answer(req, originals, [])
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
        return self._batch_answer(req, originals, results)

    def _batch_answer(
        self, req: SendBatchMessage, originals: list[Original | None], results: list[PutResult]
    ) -> BatchResult | asyncio.Future[BatchResult]:
        """The answer to a batch: each entry's commit-log offset (a retried entry's
        original's); queue, queue offset and store time of the first entry."""
        stored = iter(results)
        offsets: list[str] = []
        first: tuple[int, int, int] | None = None
        end = 0
        for original in originals:
            if original is None:
                r = next(stored)
                phy, end_offset = r.commit_log_offset, r.end_offset
                where = (req.queue_id, r.queue_offset, r.store_timestamp)
            else:
                phy, end_offset = original.commit_log_offset, original.end_offset
                where = (original.queue_id, original.queue_offset, original.store_timestamp)
            offsets.append(f"{phy:016X}")
            end = max(end, end_offset)
            if first is None:
                first = where
        assert first is not None
        answer = BatchResult(
            msg_ids=[e.properties.get(Prop.UNIQ_KEY, "") for e in req.messages],
            offset_msg_ids=offsets,
            queue_id=first[0],
            queue_offset=first[1],
            store_timestamp=first[2],
        )
        return self.ctx.acks.after_flush(end, answer)

    def _delayed(self, topic: str, queue_id: int, props: dict[str, str]) -> Delayed | None:
        return self.schedule.destination(topic, queue_id, props)

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
