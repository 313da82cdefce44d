"""Client lifecycles: start and stop from different tasks, reconnect after a broker restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.conftest import BrokerProcess
from txmq import BrokerUnavailable, Message, Producer
from txmq.broker.server import EmbeddedBroker

pytestmark = pytest.mark.anyio


async def test_start_and_stop_in_different_tasks(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    producer = Producer(eb.address)
    await asyncio.create_task(producer.start())  # e.g. a web framework's startup hook
    r = await asyncio.create_task(producer.send(Message("life", b"x")))
    assert r.queue_offset == 0
    await asyncio.create_task(producer.stop())  # ... and its shutdown hook
    assert not producer.started
    with pytest.raises(BrokerUnavailable, match="not started"):
        await producer.send(Message("life", b"y"))


async def test_wrong_address_fails_at_start() -> None:
    with pytest.raises(BrokerUnavailable, match=r"cannot connect to broker 127\.0\.0\.1:1"):
        async with Producer("127.0.0.1:1"):
            pass


async def test_producer_reconnects_after_broker_restart(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    async with Producer(bp.address, retry_times=0) as producer:
        await producer.send(Message("re", b"1"), queue_id=0)
        assert bp.terminate() == 0
        with pytest.raises(BrokerUnavailable):
            await producer.send(Message("re", b"2"), queue_id=0)
        bp.args += ["--port", bp.address.rsplit(":", 1)[1]]
        bp.start()
        r = await producer.send(Message("re", b"3"), queue_id=0)
        assert r.queue_offset == 1
    bp.terminate()
