"""PULL_MESSAGE with long polling, and consumer groups' offsets."""

from __future__ import annotations

import time
from collections.abc import Awaitable

import anyio

from txmq.broker.state.context import BrokerContext
from txmq.broker.state.topics import check_queue_id
from txmq.broker.store import GetResult, GetStatus
from txmq.protocol.message import parse_subscription
from txmq.protocol.rpc import Call
from txmq.protocol.wire import (
    Empty,
    GetMaxOffset,
    GetMinOffset,
    Offset,
    Pulled,
    PullMessage,
    QueryConsumerOffset,
    UpdateConsumerOffset,
    WithBody,
)
from txmq.protocol.wire.errors import BadRequest, TopicNotFound
from txmq.protocol.wire.messaging import PullStatus

__all__ = ["MAX_PULL_BATCH", "PullService", "parse_subscription"]

MAX_PULL_BATCH = 1024
_PULL_STATUS: dict[GetStatus, PullStatus] = {
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

Answer = WithBody[Pulled]


def _answer(result: GetResult, ctx: BrokerContext, req: PullMessage) -> Answer:
    ctx.throughput.got += len(result.records)
    tally = ctx.throughput.tally
    if tally is not None:
        tally.handed_out(
            req.group, req.topic, req.queue_id, result.records, result.next_begin_offset
        )
    suggest = 0
    if result.first_phy_offset >= 0:
        suggest = ctx.replica.read_from(ctx.store.commit_log_max_offset - result.first_phy_offset)
    pulled = Pulled(
        status=_PULL_STATUS[result.status],
        next_offset=result.next_begin_offset,
        min_offset=result.min_offset,
        max_offset=result.max_offset,
        suggest_broker_id=suggest,
    )
    return WithBody(pulled, b"".join(result.records))


class PullService:
    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self.store = ctx.store

    def pull(self, req: PullMessage, call: Call) -> Answer | Awaitable[Answer]:
        topic, queue_id, offset = req.topic, req.queue_id, req.offset
        max_msgs = min(max(req.max_msgs, 1), MAX_PULL_BATCH)
        tag_codes = parse_subscription(req.subscription)
        self._check_queue(topic, queue_id)  # no long poll may wait on a queue that is not
        result = self.store.get_messages(topic, queue_id, offset, max_msgs, tag_codes=tag_codes)
        if result.status in _WAITABLE and req.suspend_ms > 0:
            # registered now: the coroutine below starts a loop iteration later (remoting
            # runs it as a task), and a message stored meanwhile must still wake it
            arrival = self.ctx.arrivals.event(topic, queue_id)
            return self._long_poll(req, max_msgs, tag_codes, arrival)
        return _answer(result, self.ctx, req)

    async def _long_poll(
        self,
        req: PullMessage,
        max_msgs: int,
        tag_codes: set[int] | None,
        arrival: anyio.Event,
    ) -> Answer:
        topic, queue_id, offset = req.topic, req.queue_id, req.offset
        limit = min(req.suspend_ms / 1000, self.ctx.config.long_polling_max_s)
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                with anyio.move_on_after(remaining):
                    await arrival.wait()
            result = self.store.get_messages(topic, queue_id, offset, max_msgs, tag_codes=tag_codes)
            if result.status not in _WAITABLE or remaining <= 0:
                return _answer(result, self.ctx, req)
            arrival = self.ctx.arrivals.event(topic, queue_id)  # same step as the empty read

    # -- offsets ----------------------------------------------------------------------------

    def update_offset(self, req: UpdateConsumerOffset, call: Call) -> Empty:
        """Commit a group's offset of a queue the broker has (nothing else is saved)."""
        self._check_queue(req.topic, req.queue_id)
        if req.offset < 0:
            raise BadRequest(f"offset {req.offset} is negative")
        # a slave takes commits while its master is away, and hands them back later
        hand_back = not self.ctx.replica.is_master()
        self.ctx.offsets.commit(req.group, req.topic, req.queue_id, req.offset, hand_back=hand_back)
        return Empty()

    def _check_queue(self, topic: str, queue_id: int) -> None:
        cfg = self.ctx.topics.get(topic)
        if cfg is None:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        check_queue_id(cfg, queue_id)

    def query_offset(self, req: QueryConsumerOffset, call: Call) -> Offset:
        return Offset(offset=self.ctx.offsets.query(req.group, req.topic, req.queue_id))

    def max_offset(self, req: GetMaxOffset, call: Call) -> Offset:
        return Offset(offset=self.store.max_offset(req.topic, req.queue_id))

    def min_offset(self, req: GetMinOffset, call: Call) -> Offset:
        return Offset(offset=self.store.min_offset(req.topic, req.queue_id))
