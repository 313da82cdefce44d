"""The pop service (RocketMQ 5's ReceiveMessage / Ack / ChangeInvisibleDuration / DLQ) on a
real message store in a temporary directory, with its expiry loop running."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from txmq.broker.consumption.pop import MAX_POP_BATCH, Popped, PopService
from txmq.broker.consumption.retry import RetryService
from txmq.broker.delivery.schedule import ScheduleMessageService
from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.context import Arrivals, BrokerContext, FlushAcks
from txmq.broker.state.groups import ConsumerManager, ProducerManager
from txmq.broker.state.locks import RebalanceLockManager
from txmq.broker.state.offsets import ConsumerOffsetManager
from txmq.broker.state.topics import TopicManager
from txmq.broker.store import GetStatus, MessageStore
from txmq.protocol.codec import decode_records
from txmq.protocol.message import MessageExt, Prop, dlq_topic, new_message_id, retry_topic, tag_hash
from txmq.protocol.wire.errors import BadRequest, InvalidReceiptHandle, NotMaster, TopicNotFound

pytestmark = pytest.mark.anyio

G = "g1"
T = "orders"


@dataclass
class Env:
    ctx: BrokerContext
    svc: PopService
    retry: RetryService

    def put(
        self, queue_id: int = 0, body: bytes = b"m", *, topic: str = T, tags: str | None = None
    ) -> None:
        props = {Prop.UNIQ_KEY: new_message_id()}
        if tags:
            props[Prop.TAGS] = tags
        self.ctx.store.put(
            topic=topic, queue_id=queue_id, body=body, properties=props, born_timestamp=1
        )
        self.ctx.arrivals.notify(topic, queue_id)  # as SendService does

    async def pop(self, **kw: Any) -> list[Popped]:
        args: dict[str, Any] = dict(
            group=G,
            topic=T,
            max_msgs=MAX_POP_BATCH,
            invisible_ms=60_000,
            poll_ms=0,
            tag_codes=None,
            fifo=False,
            max_attempts=16,
        )
        args.update(kw)
        return await self.svc.pop(**args)

    def ack(self, p: Popped, *, topic: str = T, group: str = G) -> None:
        self.svc.ack(group=group, topic=topic, handle=p.handle)

    def committed(self, queue_id: int = 0, topic: str = T) -> int:
        return self.ctx.offsets.query(G, topic, queue_id)

    def read(self, topic: str) -> list[MessageExt]:
        got = self.ctx.store.get_messages(topic, 0, 0, 100)
        if got.status is not GetStatus.FOUND:
            return []
        return decode_records(b"".join(got.records))


class _Slave:
    def is_master(self) -> bool:
        return False

    def read_from(self, behind: int) -> int:
        return 0


@asynccontextmanager
async def env(tmp_path: Path, *, queues: int = 4, run: bool = True) -> AsyncIterator[Env]:
    config = BrokerConfig(
        store=tmp_path / "store",
        segment_size=1024 * 1024,
        max_message_size=64 * 1024,
        export_segments=False,
    )
    store = MessageStore(config.store_config())
    store.start()
    topics = TopicManager(
        tmp_path / "store" / "config" / "topics.json", auto_create=False, default_queue_nums=4
    )
    topics.create_or_update(T, queues)
    ctx = BrokerContext(
        config=config,
        store=store,
        topics=topics,
        offsets=ConsumerOffsetManager(tmp_path / "store" / "config" / "offsets.json"),
        consumers=ConsumerManager(),
        producers=ProducerManager(),
        locks=RebalanceLockManager(60),
        arrivals=Arrivals(),
        acks=FlushAcks(store, config),
    )
    retry = RetryService(ctx, ScheduleMessageService(ctx))
    e = Env(ctx, PopService(ctx, retry), retry)
    try:
        async with anyio.create_task_group() as tg:
            if run:
                await tg.start(e.svc.run)
            yield e
            tg.cancel_scope.cancel()
    finally:
        store.shutdown()


async def test_pop_spreads_over_queues_then_nothing_more(tmp_path: Path) -> None:
    async with env(tmp_path) as e:
        for q in range(4):
            e.put(q, f"{q}-a".encode())
            e.put(q, f"{q}-b".encode())
        # one at a time, the start queue rotates: four pops reach four queues
        first = [await e.pop(max_msgs=1) for _ in range(4)]
        assert sorted(p[0].msg.queue_id for p in first) == [0, 1, 2, 3]
        rest = await e.pop()
        got = [p for batch in first for p in batch] + rest
        assert sorted(p.msg.body for p in got) == sorted(
            f"{q}-{x}".encode() for q in range(4) for x in "ab"
        )
        assert all(p.attempt == 1 and p.msg.topic == T for p in got)
        assert len({p.handle for p in got}) == 8
        now = time.time() * 1000
        assert all(now + 50_000 < p.invisible_until_ms <= now + 61_000 for p in got)
        assert await e.pop() == []  # everything is in flight


async def test_ack_commits_only_up_to_the_smallest_unacked(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        for i in range(5):
            e.put(0, str(i).encode())
        got = await e.pop()
        assert [p.msg.queue_offset for p in got] == [0, 1, 2, 3, 4]
        assert e.committed() == 0
        e.ack(got[1])
        e.ack(got[2])
        assert e.committed() == 0
        e.ack(got[0])
        assert e.committed() == 3
        e.ack(got[4])
        assert e.committed() == 3
        e.ack(got[3])
        assert e.committed() == 5
        with pytest.raises(InvalidReceiptHandle, match="no longer in flight"):
            e.ack(got[3])  # twice


async def test_expiry_redelivers_through_the_retry_topic(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        e.put(0, b"late")
        (first,) = await e.pop(invisible_ms=300)
        began = time.monotonic()
        again = await e.pop(poll_ms=10_000)  # woken by the copy into %RETRY%g1
        waited = time.monotonic() - began
        assert 0.25 <= waited < 5
        (p,) = again
        assert p.msg.topic == retry_topic(G) and p.msg.body == b"late"
        assert p.attempt == 2 and p.msg.reconsume_times == 1
        assert p.msg.get_property(Prop.RETRY_TOPIC) == T
        assert p.msg.msg_id == first.msg.msg_id
        cfg = e.ctx.topics.get(retry_topic(G))
        assert cfg is not None and cfg.system and cfg.queue_nums == 1
        assert e.committed() == 1  # the original is done
        with pytest.raises(InvalidReceiptHandle):
            e.ack(first)  # redelivered meanwhile
        e.ack(p)
        assert e.committed(0, retry_topic(G)) == 1


async def test_change_invisible_replaces_the_handle(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        e.put(0, b"x")
        (p,) = await e.pop()
        q = e.svc.change_invisible(group=G, topic=T, handle=p.handle, invisible_ms=120_000)
        assert q.handle != p.handle and q.attempt == 1 and q.msg.body == b"x"
        assert q.invisible_until_ms >= p.invisible_until_ms + 50_000
        with pytest.raises(InvalidReceiptHandle, match="newer handle"):
            e.ack(p)
        # a nack: visible again after a short back-off, as the next attempt
        r = e.svc.change_invisible(group=G, topic=T, handle=q.handle, invisible_ms=200)
        (again,) = await e.pop(poll_ms=10_000)
        assert again.attempt == 2 and again.msg.body == b"x"
        with pytest.raises(InvalidReceiptHandle):
            e.ack(r)
        e.ack(again)


async def test_attempts_used_up_go_to_the_dlq(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        e.put(0, b"poison")
        (p1,) = await e.pop(invisible_ms=150, max_attempts=2)
        (p2,) = await e.pop(invisible_ms=150, max_attempts=2, poll_ms=10_000)
        assert p2.attempt == 2 and p2.msg.topic == retry_topic(G)
        deadline = time.monotonic() + 10
        while not e.read(dlq_topic(G)):
            assert time.monotonic() < deadline, "not dead-lettered"
            await anyio.sleep(0.02)
        (dead,) = e.read(dlq_topic(G))
        assert dead.body == b"poison" and dead.reconsume_times == 2
        assert dead.msg_id == p1.msg.msg_id
        assert len(e.read(retry_topic(G))) == 1  # not copied to the retry topic again
        assert await e.pop(poll_ms=300) == []
        assert e.committed(0, retry_topic(G)) == 1
        with pytest.raises(InvalidReceiptHandle):
            e.ack(p2)


async def test_dead_letter(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        e.put(0, b"a")
        e.put(0, b"b")
        pa, pb = await e.pop()
        e.svc.dead_letter(group=G, topic=T, handle=pb.handle)
        assert [m.body for m in e.read(dlq_topic(G))] == [b"b"]
        assert e.committed() == 0  # a is still in flight
        e.ack(pa)
        assert e.committed() == 2
        with pytest.raises(InvalidReceiptHandle):
            e.svc.dead_letter(group=G, topic=T, handle=pb.handle)


async def test_fifo_blocks_a_queue_while_its_batch_is_in_flight(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        for i in range(3):
            e.put(0, str(i).encode())
        p0, p1 = await e.pop(fifo=True, max_msgs=2)
        assert await e.pop(fifo=True) == []
        e.ack(p0)
        assert await e.pop(fifo=True) == []
        e.put(0, b"3")
        assert await e.pop(fifo=True) == []
        e.ack(p1)
        assert [p.msg.body for p in await e.pop(fifo=True)] == [b"2", b"3"]


async def test_fifo_keeps_each_queues_order_through_nacks(tmp_path: Path) -> None:
    async with env(tmp_path, queues=3) as e:
        for i in range(5):  # three sharding keys, one queue each
            for q in range(3):
                e.put(q, f"{q}:{i}".encode())
        done: dict[int, list[int]] = {0: [], 1: [], 2: []}
        deadline = time.monotonic() + 30
        while sum(map(len, done.values())) < 15:
            assert time.monotonic() < deadline, done
            batch = await e.pop(fifo=True, max_msgs=4, poll_ms=5_000)
            for p in batch:
                if p.attempt == 1 and p is batch[-1]:  # a nack: back in 100 ms, in place
                    e.svc.change_invisible(group=G, topic=T, handle=p.handle, invisible_ms=100)
                else:
                    e.ack(p)
                    done[p.msg.queue_id].append(int(p.msg.body.split(b":")[1]))
        assert done == {q: [0, 1, 2, 3, 4] for q in range(3)}
        assert e.ctx.topics.get(retry_topic(G)) is None
        assert [e.committed(q) for q in range(3)] == [5, 5, 5]


async def test_fifo_expiry_redelivers_in_place(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        e.put(0, b"first")
        e.put(0, b"second")
        (p,) = await e.pop(fifo=True, max_msgs=1, invisible_ms=200, max_attempts=3)
        kw: dict[str, Any] = dict(fifo=True, max_msgs=1, invisible_ms=200, max_attempts=3)
        (p2,) = await e.pop(poll_ms=10_000, **kw)
        assert p2.msg.topic == T and p2.msg.queue_offset == 0 and p2.msg.body == b"first"
        assert p2.attempt == 2 and p2.handle != p.handle
        assert e.ctx.topics.get(retry_topic(G)) is None
        with pytest.raises(InvalidReceiptHandle):
            e.ack(p)
        (p3,) = await e.pop(poll_ms=10_000, **kw)
        assert p3.attempt == 3 and p3.msg.queue_offset == 0
        # attempt 4 would exceed max_attempts=3: dead-lettered, and the queue moves on
        (nxt,) = await e.pop(poll_ms=10_000, **kw)
        assert nxt.msg.body == b"second" and nxt.attempt == 1
        assert [m.body for m in e.read(dlq_topic(G))] == [b"first"]
        assert e.committed() == 1


async def test_long_poll_wakes_on_arrival_and_times_out(tmp_path: Path) -> None:
    async with env(tmp_path, queues=2) as e:
        got: list[Popped] = []

        async def popper() -> None:
            got.extend(await e.pop(poll_ms=20_000))

        async with anyio.create_task_group() as tg:
            tg.start_soon(popper)
            deadline = time.monotonic() + 5
            while not e.ctx.arrivals.waiting(T, 1):  # the popper found nothing
                assert time.monotonic() < deadline
                await anyio.sleep(0.01)
            began = time.monotonic()
            e.put(1, b"now")
        assert time.monotonic() - began < 2
        assert [p.msg.body for p in got] == [b"now"]
        began = time.monotonic()
        assert await e.pop(poll_ms=300) == []  # (the message is in flight)
        assert 0.28 <= time.monotonic() - began < 3


async def test_tag_filtering(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        for tag in ("a", "b", "a", "c"):
            e.put(0, tag.encode(), tags=tag)
        got = await e.pop(tag_codes={tag_hash("a")})
        assert [(p.msg.body, p.msg.queue_offset) for p in got] == [(b"a", 0), (b"a", 2)]
        for p in got:
            e.ack(p)
        assert e.committed() == 4  # the others count as consumed
        assert await e.pop() == []


async def test_start_offsets_new_group_and_restart(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        for i in range(4):
            e.put(0, str(i).encode())
        assert e.committed() == -1
        got = await e.pop(max_msgs=3)
        assert [p.msg.body for p in got] == [b"0", b"1", b"2"]  # min offset 0: from the start
        e.ack(got[0])
        assert e.committed() == 1
        # a restart loses the in-flight state: from the committed offset, old handles refused
        fresh = PopService(e.ctx, e.retry)
        again = await fresh.pop(
            group=G,
            topic=T,
            max_msgs=10,
            invisible_ms=1000,
            poll_ms=0,
            tag_codes=None,
            fifo=False,
            max_attempts=16,
        )
        assert [p.msg.body for p in again] == [b"1", b"2", b"3"]
        with pytest.raises(InvalidReceiptHandle, match="earlier run"):
            fresh.ack(group=G, topic=T, handle=got[1].handle)


async def test_the_retry_topic_is_shared_by_a_groups_topics(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        e.ctx.topics.create_or_update("other", 1)
        e.put(0, b"to-orders")
        e.put(0, b"to-other", topic="other")
        await e.pop(invisible_ms=100)
        await e.pop(topic="other", invisible_ms=100)
        deadline = time.monotonic() + 10
        while len(e.read(retry_topic(G))) < 2:
            assert time.monotonic() < deadline
            await anyio.sleep(0.02)
        (a,) = await e.pop()
        (b,) = await e.pop(topic="other")
        assert (a.msg.body, b.msg.body) == (b"to-orders", b"to-other")
        assert a.msg.topic == b.msg.topic == retry_topic(G)
        assert e.committed(0, retry_topic(G)) == 0
        with pytest.raises(InvalidReceiptHandle):
            e.ack(b)  # acked under the wrong topic
        e.ack(a)
        assert e.committed(0, retry_topic(G)) == 1
        e.ack(b, topic="other")
        assert e.committed(0, retry_topic(G)) == 2


async def test_a_slave_redelivers_in_place_and_writes_nothing(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1) as e:
        e.put(0, b"x")
        e.ctx.replica = _Slave()
        (p,) = await e.pop(invisible_ms=150, max_attempts=1)
        with pytest.raises(NotMaster):
            e.svc.dead_letter(group=G, topic=T, handle=p.handle)
        (again,) = await e.pop(poll_ms=10_000)
        assert again.msg.topic == T and again.attempt == 2
        assert e.ctx.topics.get(retry_topic(G)) is None
        assert e.ctx.topics.get(dlq_topic(G)) is None
        e.ack(again)
        assert e.committed() == 1
        assert e.ctx.offsets.pending() == {G: {T: {0: 1}}}  # handed back to the master


async def test_bad_arguments(tmp_path: Path) -> None:
    async with env(tmp_path, queues=1, run=False) as e:
        for bad in (
            {"max_msgs": 0},
            {"max_msgs": MAX_POP_BATCH + 1},
            {"invisible_ms": 0},
            {"invisible_ms": 12 * 3600 * 1000 + 1},
            {"poll_ms": -1},
            {"poll_ms": 30_001},
            {"max_attempts": 0},
            {"group": ""},
        ):
            with pytest.raises(BadRequest):
                await e.pop(**bad)
        with pytest.raises(TopicNotFound):
            await e.pop(topic="nope")
        with pytest.raises(TopicNotFound):
            e.svc.ack(group=G, topic="nope", handle="x")
        e.put(0, b"x")
        (p,) = await e.pop()
        with pytest.raises(BadRequest):
            e.svc.change_invisible(group=G, topic=T, handle=p.handle, invisible_ms=0)
        for handle in ("", "garbage", p.handle + "x", p.handle.replace(":", ";")):
            with pytest.raises(InvalidReceiptHandle):
                e.svc.ack(group=G, topic=T, handle=handle)
        with pytest.raises(InvalidReceiptHandle):
            e.ack(p, group="another-group")
        e.ack(p)
