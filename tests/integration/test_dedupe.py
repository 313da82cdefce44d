"""No duplicates from send retries: a send of a message id the broker stored moments ago is
answered with the original's result and stores nothing (broker/state/dedupe.py) — single sends,
batches, delayed and half messages, across a SIGKILL and restart."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import anyio
import pytest

from tests.conftest import BrokerProcess
from tests.grpc_support import GrpcBroker, grpc_broker
from tests.integration.test_transactions import read_topic
from txmq import Message, Producer
from txmq.broker.server import EmbeddedBroker
from txmq.client.transaction import TransactionProducer
from txmq.protocol.message import new_message_id

pytestmark = pytest.mark.anyio

__all__ = ["grpc_broker"]  # the fixture


@dataclass(slots=True)
class Resent(Message):
    """A message sent again after a lost acknowledgement: the same id every time (what a
    producer's own retry and the outbox relay do)."""

    msg_id: str = ""

    def wire_properties(self, msg_id: str) -> dict[str, str]:
        return Message.wire_properties(self, self.msg_id)


async def test_a_retried_send_is_answered_with_the_original_and_stores_nothing(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    async with Producer(eb.address) as producer:
        msg = Resent("orders", b"order 1", keys=["o1"], msg_id=new_message_id())
        first = await producer.send(msg, queue_id=0)
        again = await producer.send(msg, queue_id=2)  # a retry may pick another queue
        assert again == first
        assert (again.queue_id, again.queue_offset) == (0, 0)
        # the same id in another topic is another message
        other = await producer.send(Resent("invoices", b"x", msg_id=msg.msg_id))
        assert other.offset_msg_id != first.offset_msg_id

        # a batch: each entry on its own (two stored before, one new)
        ids = [new_message_id() for _ in range(3)]
        batch = [Resent("orders", f"b{i}".encode(), msg_id=ids[i]) for i in range(3)]
        r1 = await producer.send_batch(batch[:2], queue_id=1)
        r2 = await producer.send_batch(batch, queue_id=1)
        assert (r2.queue_id, r2.queue_offset) == (r1.queue_id, r1.queue_offset)
        assert r2.msg_ids == ids
        r3 = await producer.send_batch(batch, queue_id=3)  # all three are retries now
        assert (r3.queue_id, r3.queue_offset, r3.offset_msg_id) == (1, 0, r1.offset_msg_id)

        # a delayed message (level 1: 1 s) is stored once, delivered once
        delayed = Resent("orders", b"later", delay_level=1, msg_id=new_message_id())
        d1 = await producer.send(delayed, queue_id=0)
        d2 = await producer.send(delayed, queue_id=0)
        assert d2 == d1
        # a timer message (an exact delivery time) likewise
        timed = Resent("orders", b"timed", delay=timedelta(seconds=1), msg_id=new_message_id())
        t1 = await producer.send(timed, queue_id=0)
        assert await producer.send(timed, queue_id=3) == t1
    broker = eb.broker
    assert broker is not None and broker.context.dedupe is not None
    assert broker.context.dedupe.duplicates == 8  # 1 + 2 + 3 batch entries + 1 + 1

    with anyio.fail_after(10):
        while True:
            stored = await read_topic(eb.address, "orders")
            if {b"later", b"timed"} <= {m.body for m in stored}:
                break
            await anyio.sleep(0.2)
    counts = Counter(m.msg_id for m in stored)
    assert sorted(counts.values()) == [1] * 6  # order 1, three batch entries, delayed, timed
    assert sorted(m.body for m in stored) == [b"b0", b"b1", b"b2", b"later", b"order 1", b"timed"]


async def test_a_retried_half_message_is_the_same_transaction(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker()
    async with TransactionProducer(eb.address, "dedupe-tx") as producer:
        msg = Resent("payments", b"pay 1", msg_id=new_message_id())
        h1 = await producer.send_half(msg, transaction_id="tx-1")
        h2 = await producer.send_half(msg, transaction_id="tx-1")
        assert h2.transaction_offset == h1.transaction_offset >= 0
        assert h2 == h1
        broker = eb.broker
        assert broker is not None and len(broker.transactions.pending) == 1
        assert await producer.end_transaction(h2, "COMMIT") == "COMMITTED"
        assert not broker.transactions.pending  # no second half left to check back
    stored = await read_topic(eb.address, "payments")
    assert [m.body for m in stored] == [b"pay 1"]


async def test_dedupe_window_0_turns_it_off(
    embedded_broker: Callable[..., EmbeddedBroker],
) -> None:
    eb = embedded_broker(dedupe_window_s=0)
    async with Producer(eb.address) as producer:
        msg = Resent("orders", b"twice", msg_id=new_message_id())
        r1 = await producer.send(msg, queue_id=0)
        r2 = await producer.send(msg, queue_id=0)
    assert (r1.queue_offset, r2.queue_offset) == (0, 1)


async def test_the_window_survives_a_sigkill(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process("--flush", "sync").start()
    msgs = [Resent("crashy", f"m{i}".encode(), msg_id=new_message_id()) for i in range(300)]
    async with Producer(bp.address) as producer:
        firsts = [await producer.send(m, queue_id=i % 4) for i, m in enumerate(msgs)]
    bp.kill()  # the answers to a resend of these would be lost; the producer sends again
    bp.start()
    assert "NOT clean" in bp.output()
    assert "dedupe window: 300 key hashes" in bp.output(), bp.output()
    async with Producer(bp.address) as producer:
        agains = [await producer.send(m, queue_id=(i + 1) % 4) for i, m in enumerate(msgs)]
        assert agains == firsts
        new = await producer.send(Resent("crashy", b"new", msg_id=new_message_id()), queue_id=0)
        assert new.queue_offset == 75
    stored = await read_topic(bp.address, "crashy")
    assert len(stored) == 301 and len({m.msg_id for m in stored}) == 301
    assert bp.terminate() == 0
    # a clean restart reads the window back too
    bp.start()
    async with Producer(bp.address) as producer:
        assert await producer.send(msgs[7], queue_id=3) == firsts[7]
    assert bp.terminate() == 0


async def test_a_retry_over_the_grpc_endpoint_is_deduplicated(
    grpc_broker: Callable[..., GrpcBroker],
) -> None:
    gb = grpc_broker()
    msg = Resent("grpc-orders", b"once", msg_id=new_message_id())
    async with Producer(gb.endpoint, transport="grpc") as producer:
        first = await producer.send(msg)
        again = await producer.send(msg)  # the endpoint picks the next queue: still one copy
    assert (
        (again.msg_id, again.queue_offset)
        == (first.msg_id, first.queue_offset)
        == (
            msg.msg_id,
            0,
        )
    )
    stored = await read_topic(gb.address, "grpc-orders")
    assert [m.body for m in stored] == [b"once"]


def test_a_bad_dedupe_setting_stops_the_start_with_a_clear_error(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process()
    bp.env["TXMQ_BROKER_DEDUPE_WINDOW_S"] = "-5"
    with pytest.raises(AssertionError, match="dedupe_window_s must be between 0"):
        bp.start(timeout=20)
