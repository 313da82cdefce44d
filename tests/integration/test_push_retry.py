"""Retry with delay levels and the dead-letter queue, seen from a push consumer."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest

from txmq import AdminClient, Message, Producer
from txmq.broker.server import EmbeddedBroker
from txmq.consumer.push import ConsumeResult, PushConsumer
from txmq.protocol.message import MessageExt

pytestmark = pytest.mark.anyio

LEVELS = "10ms 20ms 40ms 60ms 80ms 100ms 120ms 140ms 160ms 180ms 200ms 220ms 240ms 260ms"


async def test_fails_twice_then_succeeds_with_delay_levels(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    attempts: list[tuple[float, int, str, str]] = []
    done = anyio.Event()

    async def listener(msg: MessageExt) -> ConsumeResult:
        attempts.append((time.perf_counter(), msg.reconsume_times, msg.topic, msg.body.decode()))
        if len(attempts) < 3:
            return ConsumeResult.RECONSUME_LATER if len(attempts) == 1 else _raise()
        done.set()
        return ConsumeResult.SUCCESS

    consumer = PushConsumer(eb.address, "g-retry", listener=listener)
    consumer.subscribe("retry-me")
    async with AdminClient(eb.address) as admin:
        await admin.create_topic("retry-me", 2)
    async with consumer, Producer(eb.address) as producer:
        await producer.send(Message("retry-me", b"payload", keys=["k1"]))
        with anyio.fail_after(15):
            await done.wait()
    assert [a[1] for a in attempts] == [0, 1, 2]
    assert {a[2] for a in attempts} == {"retry-me"} and {a[3] for a in attempts} == {"payload"}
    # first retry at level 3 (40 ms), the second at level 4 (60 ms)
    assert attempts[1][0] - attempts[0][0] >= 0.040
    assert attempts[2][0] - attempts[1][0] >= 0.060


def _raise() -> ConsumeResult:
    raise RuntimeError("handler failure counts as reconsume later")


async def test_always_failing_message_ends_in_dlq_and_resend_revives_it(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(message_delay_levels=LEVELS)
    seen: list[int] = []
    healthy = False
    revived = anyio.Event()

    async def listener(msg: MessageExt) -> ConsumeResult:
        seen.append(msg.reconsume_times)
        if healthy:
            revived.set()
            return ConsumeResult.SUCCESS
        return ConsumeResult.RECONSUME_LATER

    consumer = PushConsumer(eb.address, "g-dlq", listener=listener, max_reconsume_times=3)
    consumer.subscribe("poison")
    async with AdminClient(eb.address) as admin:
        await admin.create_topic("poison", 1)
        async with consumer, Producer(eb.address) as producer:
            r = await producer.send(Message("poison", b"bad", keys=["order-9"]))
            with anyio.fail_after(15):
                while not await admin.dlq_list("g-dlq"):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            [dead] = await admin.dlq_list("g-dlq")
            assert dead.msg_id == r.msg_id and dead.keys == ["order-9"] and dead.body == b"bad"
            assert dead.dlq_reason == "max reconsume times (3) used up"
            assert seen == [0, 1, 2, 3], seen
            healthy = True
            assert await admin.dlq_resend("g-dlq", [r.msg_id]) == 1
            with anyio.fail_after(10):
                await revived.wait()
    assert seen[-1] == 0
