"""Long polling: an empty pull is held and answered as soon as a message arrives."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from txmq import AdminClient, Message, Producer, PullConsumer, PullStatus
from txmq.broker.server import Broker, EmbeddedBroker
from txmq.broker.state.config import BrokerConfig
from txmq.protocol.wire import (
    Frame,
    FrameKind,
    PullMessage,
    Request,
    SendMessage,
    UpdateAndCreateTopic,
    WithBody,
    encode,
)

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
                while not eb.broker.arrivals.waiting("lp", 1):  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            began = time.perf_counter()
            await producer.send(Message("lp", b"wake"), queue_id=1)
            sent = time.perf_counter()
        assert got and got[0] - sent < 0.5, f"held pull answered {got[0] - began:.3f}s after send"

        began = time.perf_counter()
        res = await consumer.pull("lp", 0, 0, long_poll=0.5)
        waited = time.perf_counter() - began
        assert res.status == PullStatus.NO_NEW_MSG and 0.4 <= waited < 3


async def test_a_message_stored_before_the_held_pull_starts_waiting_still_wakes_it(
    tmp_path: Path,
) -> None:
    """The broker runs a held pull as a task, which starts a loop iteration after the read
    that found nothing; a message stored in that gap must answer the pull at once, not at
    the end of its 10 s hold."""
    broker = Broker(BrokerConfig(store=tmp_path / "store", port=0))
    async with anyio.create_task_group() as tg:
        await tg.start(broker.serve)
        try:
            handle = broker.router.handle

            def frame(request: Request[Any], body: bytes = b"") -> Frame:
                return Frame(FrameKind.REQUEST, request.CODE, 1, encode(request), body)

            create = frame(UpdateAndCreateTopic(topic="gap", queue_nums=1))
            assert not inspect.isawaitable(handle(None, create))  # type: ignore[arg-type]
            pull = frame(PullMessage(topic="gap", queue_id=0, offset=0, suspend_ms=10_000))
            held = handle(None, pull)  # type: ignore[arg-type]
            assert inspect.isawaitable(held)  # nothing there yet: the pull is held
            # the gap: a send handled before the held pull's coroutine has run at all
            sent = handle(None, frame(SendMessage(topic="gap", queue_id=0), b"in the gap"))  # type: ignore[arg-type]
            assert not inspect.isawaitable(sent)
            with anyio.fail_after(2):
                answer = await held
            assert isinstance(answer, WithBody) and b"in the gap" in answer.body, answer
        finally:
            broker.request_stop()
