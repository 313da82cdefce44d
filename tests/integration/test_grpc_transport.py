"""txmq's own clients over RocketMQ 5's gRPC protocol (``transport="grpc"``) against a real
``txmq broker start --grpc-port`` process: send → txmq's PushConsumer and the official
SimpleConsumer, sharding-key order, a delayed message, a failed message retried, a
transaction resolved by a check-back over the Telemetry stream, and clear errors for what
only txmq's protocol has."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from tests.grpc_support import (
    FilterExpression,
    GrpcBroker,
    SimpleConsumer,
    grpc_broker,
    grpc_closed_loops,
    receive_all,
    started,
)
from txmq import (
    AdminClient,
    ConsumeResult,
    DeadLetter,
    LocalTransactionState,
    Message,
    MessageExt,
    Producer,
    PushConsumer,
    TransactionProducer,
)
from txmq import sync as txsync
from txmq.protocol.message import Prop
from txmq.protocol.wire.errors import UnsupportedRequest

pytestmark = pytest.mark.anyio
#: the async tests run with grpc's completions for closed loops of earlier tests ignored
closed_loops_ignored = pytest.mark.usefixtures("grpc_closed_loops")

__all__ = ["grpc_broker", "grpc_closed_loops"]  # the fixtures


class Got:
    def __init__(self) -> None:
        self.msgs: list[MessageExt] = []
        self.lock = threading.Lock()

    def __call__(self, msg: MessageExt) -> None:
        with self.lock:
            self.msgs.append(msg)

    async def wait(self, count: int, timeout: float = 20.0) -> list[MessageExt]:
        with anyio.fail_after(timeout):
            while len(self.msgs) < count:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        return list(self.msgs)


def consumer(gb: GrpcBroker, group: str, topic: str, listener: Any, **kw: Any) -> PushConsumer:
    c = PushConsumer(gb.endpoint, group, listener=listener, transport="grpc", **kw)
    c.subscribe(topic)
    return c


@closed_loops_ignored
async def test_send_to_txmq_push_consumer_and_official_simple_consumer(
    grpc_broker: Callable[..., GrpcBroker],
) -> None:
    gb = grpc_broker()
    got = Got()
    async with Producer(gb.endpoint, transport="grpc") as producer:
        sent = [
            await producer.send(
                Message(
                    "orders", f"o{i}".encode(), tags="new", keys=[f"k{i}"], properties={"n": str(i)}
                )
            )
            for i in range(5)
        ]
        batch = await producer.send_batch([Message("orders", b"b1"), Message("orders", b"b2")])
        async with consumer(gb, "billing", "orders", got):
            msgs = await got.wait(7)
    assert sorted(m.msg_id for m in msgs) == sorted([r.msg_id for r in sent] + batch.msg_ids)
    first = next(m for m in msgs if m.body == b"o0")
    assert first.tags == "new" and first.keys == ["k0"] and first.properties == {"n": "0"}
    assert first.topic == "orders" and first.reconsume_times == 0

    # the official client reads what txmq's producer sent, with the same fields
    sub = {"orders": FilterExpression("*")}
    with started(SimpleConsumer(gb.config(), "audit", sub, await_duration=2)) as official:
        theirs = receive_all(official, 7)
    by_body = {bytes(m.body): m for m in theirs}
    assert by_body[b"o3"].tag == "new" and list(by_body[b"o3"].keys) == ["k3"]
    assert by_body[b"o3"].properties == {"n": "3"}
    assert by_body[b"o3"].message_id == sent[3].msg_id


@closed_loops_ignored
async def test_sharding_key_order_is_kept(grpc_broker: Callable[..., GrpcBroker]) -> None:
    gb = grpc_broker()
    got = Got()
    async with Producer(gb.endpoint, transport="grpc") as producer:
        for i in range(12):
            key = f"order-{i % 3}"
            await producer.send(Message("steps", f"{key}:{i // 3}".encode()), sharding_key=key)
        async with consumer(gb, "steps-readers", "steps", got, consume_concurrency=1):
            msgs = await got.wait(12)
    for k in range(3):
        mine = [m for m in msgs if m.get_property(Prop.SHARDING_KEY) == f"order-{k}"]
        assert [m.body.decode() for m in mine] == [f"order-{k}:{i}" for i in range(4)]
        assert len({m.queue_id for m in mine}) == 1  # one key, one queue


@closed_loops_ignored
async def test_a_delayed_message_arrives_after_its_delay(
    grpc_broker: Callable[..., GrpcBroker],
) -> None:
    gb = grpc_broker()
    arrived: dict[bytes, float] = {}

    def note(msg: MessageExt) -> None:
        arrived[msg.body] = time.time()

    async with Producer(gb.endpoint, transport="grpc") as producer:
        await producer.send(Message("later", b"first"))  # the topic exists before the consumer
        async with consumer(gb, "later-readers", "later", note):
            with anyio.fail_after(20):
                while b"first" not in arrived:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            began = time.time()
            await producer.send(Message("later", b"in 1s", delay_level=1))
            await producer.send(Message("later", b"now"))
            with anyio.fail_after(20):
                while len(arrived) < 3:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
    assert arrived[b"now"] < arrived[b"in 1s"]
    assert arrived[b"in 1s"] - began >= 0.9  # level 1: 1 s


@closed_loops_ignored
async def test_a_failed_message_comes_back_with_its_attempt_counted(
    grpc_broker: Callable[..., GrpcBroker],
) -> None:
    gb = grpc_broker()
    tries: list[int] = []

    def flaky(msg: MessageExt) -> ConsumeResult:
        tries.append(msg.reconsume_times)
        return ConsumeResult.RECONSUME_LATER if len(tries) < 3 else ConsumeResult.SUCCESS

    async with consumer(gb, "flaky", "retries", flaky):
        async with Producer(gb.endpoint, transport="grpc") as producer:
            await producer.send(Message("retries", b"x"))
        with anyio.fail_after(20):
            while len(tries) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    assert tries == [0, 1, 2]  # the broker's retry back-off (1 s here), attempts counted


@closed_loops_ignored
async def test_a_dead_letter_on_purpose_goes_to_the_dlq_with_its_reason(
    grpc_broker: Callable[..., GrpcBroker],
) -> None:
    gb = grpc_broker()
    seen: list[str] = []

    def refuse(msg: MessageExt) -> None:
        seen.append(msg.msg_id)
        raise DeadLetter("bad <payload>\nline 2")

    async with consumer(gb, "refusers", "refused", refuse):
        async with Producer(gb.endpoint, transport="grpc") as producer:
            r = await producer.send(Message("refused", b"x"))
        async with AdminClient(gb.address) as admin:  # txmq's protocol: the DLQ's listing
            with anyio.fail_after(20):
                while not (dead := await admin.dlq_list("refusers")):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
    assert [(m.msg_id, m.dlq_reason) for m in dead] == [(r.msg_id, "bad <payload>\nline 2")]
    assert seen == [r.msg_id]  # once: no retries


@closed_loops_ignored
async def test_transaction_check_back_over_the_telemetry_stream(
    grpc_broker: Callable[..., GrpcBroker],
) -> None:
    gb = grpc_broker()
    checked: list[MessageExt] = []

    class Undecided:
        def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
            return (
                LocalTransactionState.COMMIT if arg == "commit" else LocalTransactionState.UNKNOWN
            )

        def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
            checked.append(msg)
            return LocalTransactionState.COMMIT

    got = Got()
    async with (
        TransactionProducer(gb.endpoint, "pay-tx", listener=Undecided(), transport="grpc") as tp,
        consumer(gb, "ledger", "payments", got),
    ):
        await tp.send_message_in_transaction(Message("payments", b"direct"), "commit")
        await tp.send_message_in_transaction(
            Message("payments", b"checked", keys=["p-2"]), "unknown", transaction_id="tx-2"
        )
        msgs = await got.wait(2, timeout=30)
    assert sorted(m.body for m in msgs) == [b"checked", b"direct"]
    assert len(checked) >= 1
    half = checked[0]
    assert half.body == b"checked" and half.topic == "payments" and half.keys == ["p-2"]
    assert half.get_property(Prop.TRANSACTION_ID) == "tx-2"  # txmq's id, unharmed
    assert half.get_property(Prop.PRODUCER_GROUP) == "pay-tx"


def test_sync_facade_and_what_only_txmqs_protocol_has(
    grpc_broker: Callable[..., GrpcBroker],
) -> None:
    gb = grpc_broker()
    with txsync.Producer(gb.endpoint, transport="grpc") as producer:
        assert producer.send(Message("plain", b"x")).msg_id
        with pytest.raises(UnsupportedRequest, match="queue itself"):
            producer.send(Message("plain", b"x"), queue_id=1)
        with pytest.raises(UnsupportedRequest, match="QueryConsumerOffset"):
            producer._call(producer.aio.call, _offset_query())
    with pytest.raises(ValueError, match="txmq's own protocol only"):
        txsync.PullConsumer(gb.endpoint, transport="grpc")


def _offset_query() -> Any:
    from txmq.protocol.wire import QueryConsumerOffset

    return QueryConsumerOffset(group="g", topic="plain", queue_id=0)
