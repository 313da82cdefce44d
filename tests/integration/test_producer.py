"""Producer send modes and queue selection."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest

from txmq import AdminClient, Message, Producer, PullConsumer, SendResult, TopicNotFound
from txmq.broker.server import EmbeddedBroker
from txmq.protocol.message import Prop, stable_hash

pytestmark = pytest.mark.anyio


async def _bodies(address: str, topic: str, queue_id: int) -> list[bytes]:
    async with PullConsumer(address) as c:
        res = await c.pull(topic, queue_id, 0, max_msgs=1000, long_poll=0)
        return [m.body for m in res.messages]


async def test_sharding_key_selector_and_round_robin(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    async with AdminClient(eb.address) as admin:
        await admin.create_topic("sel", 8)
    async with Producer(eb.address) as p:
        keyed = [await p.send(Message("sel", b"k"), sharding_key="order-42") for _ in range(5)]
        assert {r.queue_id for r in keyed} == {stable_hash("order-42") % 8}
        assert [r.queue_offset for r in keyed] == list(range(5))
        chosen = await p.send(Message("sel", b"s"), selector=lambda n, m, arg: arg % n, arg=13)
        assert chosen.queue_id == 13 % 8
        spread = [await p.send(Message("sel", b"r")) for _ in range(16)]
        assert sorted({r.queue_id for r in spread}) == list(range(8))
        with pytest.raises(ValueError, match="selector returned"):
            await p.send(Message("sel", b"x"), selector=lambda n, m, arg: n)
    async with PullConsumer(eb.address) as c:
        res = await c.pull("sel", keyed[0].queue_id, 0, long_poll=0)
        assert res.messages[0].get_property(Prop.SHARDING_KEY) == "order-42"


async def test_async_send_with_callback_and_oneway(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    results: list[SendResult] = []
    all_done = anyio.Event()

    def callback(result: SendResult | None, error: BaseException | None) -> None:
        assert error is None and result is not None
        results.append(result)
        if len(results) == 10:
            all_done.set()

    async with Producer(eb.address) as p:
        for i in range(10):
            p.send_async(Message("modes", f"a{i}".encode()), callback, queue_id=0)
        with anyio.fail_after(10):
            await all_done.wait()
        assert sorted(r.queue_offset for r in results) == list(range(10))
        for i in range(5):
            await p.send_oneway(Message("modes", f"o{i}".encode()), queue_id=1)
        with anyio.fail_after(10):
            while len(await _bodies(eb.address, "modes", 1)) < 5:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert await _bodies(eb.address, "modes", 1) == [f"o{i}".encode() for i in range(5)]


async def test_auto_create_switched_off(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    eb = embedded_broker(auto_create_topic=False)
    async with Producer(eb.address) as p:
        with pytest.raises(TopicNotFound, match="auto-creation is off"):
            await p.send(Message("nope", b"x"))
        async with AdminClient(eb.address) as admin:
            await admin.create_topic("yes", 2)
            r = await p.send(Message("yes", b"x"))
            assert r.queue_id in (0, 1)
            await admin.create_topic("yes", 6)  # update: more queues
            topics = {t.topic: t for t in await admin.topics()}
            assert topics["yes"].queue_nums == 6
