"""Long polling: an empty pull is held and answered as soon as a message arrives."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest

from broker.server import EmbeddedBroker
from txmq import AdminClient, Message, Producer, PullConsumer, PullStatus

pytestmark = pytest.mark.anyio


async def test_held_pull_answers_when_a_message_arrives(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    assert eb.broker is not None
    async with AdminClient(eb.address) as admin:
        await admin.create_topic("lp", 2)
    async with PullConsumer(eb.address) as consumer, Producer(eb.address) as producer:
        got: list[float] = []

        async def pull() -> None:
            res = await consumer.pull("lp", 1, 0, long_poll=10)
            got.append(time.perf_counter())
            assert res.status == PullStatus.FOUND and res.messages[0].body == b"wake"

        async with anyio.create_task_group() as tg:
            tg.start_soon(pull)
            with anyio.fail_after(5):  # wait until the broker holds the pull
                while ("lp", 1) not in eb.broker._arrivals:  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            began = time.perf_counter()
            await producer.send(Message("lp", b"wake"), queue_id=1)
            sent = time.perf_counter()
        assert got and got[0] - sent < 0.5, f"held pull answered {got[0] - began:.3f}s after send"

        began = time.perf_counter()
        res = await consumer.pull("lp", 0, 0, long_poll=0.5)
        waited = time.perf_counter() - began
        assert res.status == PullStatus.NO_NEW_MSG and 0.4 <= waited < 3
