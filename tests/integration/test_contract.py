"""One contract, every transport: the same producer, consumer and transaction cases over
txmq's protocol, RocketMQ 5's gRPC endpoint and an in-process broker (loopback).  Each case
checks every message it sent, not a sample."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from tests.outbox_support import until
from tests.sqla_support import TRANSPORTS, Via, start_broker
from txmq import (
    AdminClient,
    ConsumeFrom,
    ConsumeResult,
    DeadLetter,
    LocalTransactionState,
    Message,
    MessageExt,
    Producer,
    PushConsumer,
    TransactionProducer,
)
from txmq.broker.server import EmbeddedBroker

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("transport", TRANSPORTS)]

#: retries come back in tens of milliseconds, check-backs within a second
SETTINGS: dict[str, Any] = {
    "message_delay_levels": "10ms 20ms 40ms 60ms 80ms 100ms 120ms 140ms 160ms 180ms 200ms",
    "transaction_check_interval_s": 0.1,
    "transaction_timeout_s": 0.3,
}


@pytest.fixture
def via(transport: str, embedded_broker: Callable[..., EmbeddedBroker]) -> Via:
    return start_broker(embedded_broker, transport, **SETTINGS)


async def _topic(via: Via, topic: str, queues: int = 4) -> None:
    async with AdminClient(via.broker.address) as admin:  # (txmq's protocol)
        await admin.create_topic(topic, queues)


def _consumer(via: Via, group: str, topic: str, listener: Any, **kw: Any) -> PushConsumer:
    consumer = PushConsumer(
        via.address,
        group,
        listener=listener,
        consume_from=ConsumeFrom.FIRST_OFFSET,
        persist_interval=0.1,
        invisible_time=1.0,
        **via.kw,
        **kw,
    )
    consumer.subscribe(topic)
    return consumer


async def test_what_is_sent_is_consumed_once_each_in_order_per_key(via: Via) -> None:
    await _topic(via, "c-orders")
    sent: dict[str, list[bytes]] = defaultdict(list)
    async with Producer(via.address, **via.kw) as producer:
        for i in range(60):
            key = f"order-{i % 6}"
            body = f"{key}:{i}".encode()
            await producer.send(Message("c-orders", body, keys=[key]), sharding_key=key)
            sent[key].append(body)
    got: dict[str, list[bytes]] = defaultdict(list)

    async def listener(msg: MessageExt) -> None:
        got[msg.keys[0]].append(msg.body)

    async with _consumer(via, "c-readers", "c-orders", listener, consume_concurrency=1):
        await until(lambda: sum(map(len, got.values())) >= 60, timeout=30)
    assert dict(got) == dict(sent)


async def test_a_failed_message_comes_back_with_its_count_and_a_dead_letter_goes_to_the_dlq(
    via: Via,
) -> None:
    await _topic(via, "c-retry")
    async with Producer(via.address, **via.kw) as producer:
        await producer.send(Message("c-retry", b"later", keys=["later"]))
        await producer.send(Message("c-retry", b"poison", keys=["poison"]))
    attempts: dict[bytes, list[int]] = defaultdict(list)

    async def listener(msg: MessageExt) -> ConsumeResult:
        attempts[msg.body].append(msg.reconsume_times)
        if msg.body == b"poison":
            raise DeadLetter("cannot be parsed")
        done = len(attempts[b"later"]) >= 3
        return ConsumeResult.SUCCESS if done else ConsumeResult.RECONSUME_LATER

    async with _consumer(via, "c-retriers", "c-retry", listener):
        await until(lambda: len(attempts[b"later"]) >= 3, timeout=30)
    assert attempts[b"later"] == [0, 1, 2]
    assert attempts[b"poison"] == [0]
    async with AdminClient(via.broker.address) as admin:

        async def dead() -> list[bytes]:
            page = await admin.dlq_list("c-retriers")
            return [m.body for m in page]

        assert await until(dead, timeout=30) == [b"poison"]


class _Listener:
    """Commits the bodies that say so, rolls back the others, answers UNKNOWN for
    "unknown-*" until the check-back, which commits them."""

    def __init__(self) -> None:
        self.checked: list[bytes] = []

    async def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
        if msg.body.startswith(b"commit"):
            return LocalTransactionState.COMMIT
        if msg.body.startswith(b"unknown"):
            return LocalTransactionState.UNKNOWN
        return LocalTransactionState.ROLLBACK

    async def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        self.checked.append(msg.body)
        return LocalTransactionState.COMMIT


async def test_transactions_commit_roll_back_and_are_checked_back(via: Via) -> None:
    await _topic(via, "c-tx")
    listener = _Listener()
    bodies = [b"commit-1", b"rollback-1", b"unknown-1", b"commit-2", b"rollback-2", b"unknown-2"]
    producer = TransactionProducer(via.address, "c-tx-producers", listener=listener, **via.kw)
    async with producer as tx:
        states = [
            (await tx.send_message_in_transaction(Message("c-tx", body))).local_state
            for body in bodies
        ]
        assert [s.value for s in states] == ["COMMIT", "ROLLBACK", "UNKNOWN"] * 2
        got: list[bytes] = []

        async def consume(msg: MessageExt) -> None:
            got.append(msg.body)

        async with _consumer(via, "c-tx-readers", "c-tx", consume):
            await until(lambda: len(got) >= 4, timeout=30)
            await anyio.sleep(0.5)  # a rolled-back message would have arrived by now
    assert sorted(got) == [b"commit-1", b"commit-2", b"unknown-1", b"unknown-2"]
    assert sorted(set(listener.checked)) == [b"unknown-1", b"unknown-2"]
