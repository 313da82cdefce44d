"""The push consumer's pull loop against a scripted broker: what it commits and pulls again
when the broker says an offset is outside the queue (a new master that lacks the old one's
last records)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.outbox_support import until
from txmq.consumer.model import ConsumeFrom, ConsumeResult, MessageModel
from txmq.consumer.offsets import _Table
from txmq.consumer.pull import PullResult, PullStatus
from txmq.consumer.pulling import PullMode
from txmq.protocol.message import MessageExt, MessageQueue

pytestmark = pytest.mark.anyio

MQ = MessageQueue("replies", "a", 0)


def _record(offset: int, body: bytes) -> MessageExt:
    return MessageExt(MQ.topic, body, MQ.queue_id, offset, 1000 + offset, 100, 0, 0)


class _Failover:
    """A queue's broker set: the old master holds records 0-9, the pull at offset 10 goes
    to the new master, which had 0-7 replicated (8 and 9 were never acknowledged) and has
    written a record of its own at 8 since."""

    def __init__(self) -> None:
        self.old = [_record(i, b"old-%d" % i) for i in range(10)]
        self.new = [*self.old[:8], _record(8, b"new-8")]
        self.failed_over = False
        #: set by the test: the master dies (a pull past the old records waits for it)
        self.failover = anyio.Event()
        self.pulled_at: list[int] = []

    async def pull(self, topic: str, queue_id: int, offset: int, **_: Any) -> PullResult:
        self.pulled_at.append(offset)
        if offset >= len(self.old) and not self.failed_over:
            await self.failover.wait()
            self.failed_over = True
        records = self.new if self.failed_over else self.old
        end = len(records)
        if offset > end:  # RocketMQ's OFFSET_OVERFLOW_BADLY: go on at the queue's end
            return PullResult(PullStatus.OFFSET_ILLEGAL, end, 0, end)
        found = records[offset : offset + 32]
        if not found:
            await anyio.sleep(0.01)  # (a long poll that found nothing)
            return PullResult(PullStatus.NO_NEW_MSG, offset, 0, end)
        return PullResult(PullStatus.FOUND, offset + len(found), 0, end, list(found))


class _Consumer:
    """The push consumer's side that pulling sees: a listener that holds records 5 and up
    until released."""

    group = "g"
    client_id = "c"
    message_model = MessageModel.CLUSTERING
    orderly = False
    consume_from = ConsumeFrom.FIRST_OFFSET
    pull_batch_size = 32
    pull_threshold_count = 1000
    pull_threshold_size = 1 << 30
    max_span = 2000
    long_poll = 0.0
    pull_delay_on_error = 0.01

    def __init__(self, tg: Any, broker: _Failover) -> None:
        self.tg = tg
        self.puller = broker
        self.offsets = _Table()
        self.release = anyio.Event()
        self.delivered: list[bytes] = []

    def all_subscriptions(self) -> dict[str, str]:
        return {MQ.topic: "*"}

    def submit(self, job: Any) -> None:
        self.tg.start_soon(job)

    async def invoke(self, msg: MessageExt) -> tuple[ConsumeResult, str]:
        if msg.queue_offset >= 5:
            await self.release.wait()
        self.delivered.append(msg.body)
        return ConsumeResult.SUCCESS, ""


async def test_an_offset_outside_the_queue_commits_nothing_over_messages_in_flight() -> None:
    broker = _Failover()
    async with anyio.create_task_group() as tg:
        consumer = _Consumer(tg, broker)
        mode = PullMode(consumer)  # type: ignore[arg-type]
        mode._tg = tg
        mode.start_queue(MQ, 0)
        await until(lambda: consumer.offsets.table.get(MQ) == 5, 5, "0-4 not committed")
        broker.failover.set()
        await until(lambda: len(broker.pulled_at) >= 3, 5, "no pull after the failover")
        # 5-9 are still being consumed: the committed offset stays at the first of them
        # (committing the new master's end, 8, would lose 5-7 should the process die now),
        # and the queue is pulled again from there, on the new master
        assert broker.pulled_at[:3] == [0, 10, 5], broker.pulled_at
        assert consumer.offsets.table[MQ] == 5
        consumer.release.set()
        await until(lambda: consumer.offsets.table.get(MQ) == 9, 5, "not all committed")
        tg.cancel_scope.cancel()
    # the new master's own record at 8 is consumed, and 5-7 at least once
    assert b"new-8" in consumer.delivered
    assert {b"old-%d" % i for i in range(8)} <= set(consumer.delivered)
