"""Send 100,000 messages over several topics and queues and pull them all back."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from txmq import AdminClient, Message, Producer, PullConsumer, PullStatus
from txmq.broker.server import EmbeddedBroker

pytestmark = pytest.mark.anyio

TOPICS = {"roundtrip-a": 4, "roundtrip-b": 8, "roundtrip-c": 3}


async def _pull_all(consumer: PullConsumer, topic: str, queue_id: int) -> list[Any]:
    out = []
    offset = 0
    while True:
        res = await consumer.pull(topic, queue_id, offset, max_msgs=256, long_poll=0)
        if res.status != PullStatus.FOUND:
            assert res.status == PullStatus.NO_NEW_MSG, res.status
            return out
        out.extend(res.messages)
        offset = res.next_offset


async def test_100k_messages_roundtrip(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    broker = embedded_broker()
    rng = random.Random(7)
    # expected[(topic, queue)][queue offset] = (msg id, body, keys, tags, properties)
    expected: dict[tuple[str, int], dict[int, tuple[Any, ...]]] = {}
    total = 0
    async with AdminClient(broker.address) as admin:
        for topic, queues in TOPICS.items():
            await admin.create_topic(topic, queues)

    def remember(topic: str, qid: int, offset: int, msg_id: str, msg: Message) -> None:
        slot = expected.setdefault((topic, qid), {})
        assert offset not in slot, "two messages got the same queue offset"
        slot[offset] = (msg_id, msg.body, msg.key_list(), msg.tags, msg.properties)

    def make(i: int, topic: str) -> Message:
        body = rng.randbytes(rng.randint(0, 300))
        return Message(
            topic,
            body,
            tags=f"tag{i % 5}",
            keys=[f"key-{i % 1000}", f"n{i}"],
            properties={"seq": str(i), "kind": "roundtrip"},
        )

    # a correctness test: under a loaded CI machine 256 sends in flight may wait past 3 s
    async with Producer(broker.address, send_timeout=30) as producer:
        limiter = anyio.Semaphore(256)

        async def single(i: int, topic: str) -> None:
            async with limiter:
                msg = make(i, topic)
                r = await producer.send(msg)
                remember(topic, r.queue_id, r.queue_offset, r.msg_id, msg)

        async def batch(start: int, topic: str, qid: int) -> None:
            async with limiter:
                msgs = [make(start + j, topic) for j in range(100)]
                r = await producer.send_batch(msgs, queue_id=qid)
                for j, m in enumerate(msgs):
                    remember(topic, qid, r.queue_offset + j, r.msg_ids[j], m)

        names = list(TOPICS)
        async with anyio.create_task_group() as tg:
            i = 0
            while i < 30_000:
                tg.start_soon(single, i, names[i % 3])
                i += 1
            while i < 100_000:
                topic = names[(i // 100) % 3]
                tg.start_soon(batch, i, topic, (i // 300) % TOPICS[topic])
                i += 100
        total = sum(len(v) for v in expected.values())
        assert total == 100_000

    pulled = 0
    async with PullConsumer(broker.address, "roundtrip") as consumer:
        for topic, queues in TOPICS.items():
            for qid in range(queues):
                msgs = await _pull_all(consumer, topic, qid)
                want = expected.get((topic, qid), {})
                assert [m.queue_offset for m in msgs] == list(range(len(want)))
                for m in msgs:
                    msg_id, body, keys, tags, props = want[m.queue_offset]
                    assert (m.msg_id, m.body, m.keys, m.tags, m.properties) == (
                        msg_id,
                        body,
                        keys,
                        tags,
                        props,
                    )
                    assert (m.topic, m.queue_id) == (topic, qid)
                pulled += len(msgs)
    assert pulled == 100_000

    flat = [(t, q, o, v) for (t, q), slot in expected.items() for o, v in slot.items()]
    async with AdminClient(broker.address) as admin:
        for topic, qid, offset, (msg_id, body, *_rest) in rng.sample(flat, 200):
            found = await admin.message_by_id(msg_id)
            assert (found.topic, found.queue_id, found.queue_offset, found.body) == (
                topic,
                qid,
                offset,
                body,
            )
        for k in ("key-0", "key-999", "key-500"):
            hits = await admin.messages_by_key(k, max_num=1000)
            assert len(hits) == 100 and all(k in m.keys for m in hits)
        one = await admin.messages_by_key("n12345")
        assert [m.properties["seq"] for m in one] == ["12345"]
