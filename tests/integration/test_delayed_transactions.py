"""Transactional messages with a delay or a delivery time (RocketMQ refuses them): the
message commits with its local transaction and is delivered at its time; a rolled-back one
never is; a commit decided by a check-back waits the same way."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import anyio
import pytest

import txmq
from tests.conftest import BrokerProcess
from txmq import LocalTransactionState, Message
from txmq.protocol.wire.errors import BadRequest, MessageNotFound
from txmq.testing import InProcessBroker

pytestmark = pytest.mark.anyio

S = LocalTransactionState


@pytest.fixture
def broker(in_process_broker: Callable[..., InProcessBroker]) -> InProcessBroker:
    return in_process_broker(transaction_timeout_s=0.5)


async def _delivered(broker: InProcessBroker, topic: str, want: list[bytes]) -> None:
    """Poll (with a deadline) until ``topic`` holds exactly ``want``."""
    for _ in range(1000):
        if sorted(broker.bodies(topic)) == want:
            return
        await anyio.sleep(0.01)
    assert sorted(broker.bodies(topic)) == want


async def test_a_delayed_transactional_message_comes_at_its_time_after_its_commit(
    broker: InProcessBroker,
) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)
    async with txmq.TransactionProducer(group="deadlines") as p:
        timer = await p.send_half(Message("d", b"at", deliver_at=at), transaction_id="t1")
        level = await p.send_half(Message("d", b"level", delay_level=3), transaction_id="t2")
        gone = await p.send_half(Message("d", b"rolled-back", delay=timedelta(minutes=5)),
                                 transaction_id="t3")  # fmt: skip
        due = await p.send_half(Message("d", b"due", deliver_at=datetime.now(UTC)),
                                transaction_id="t4")  # fmt: skip
        assert broker.bodies("d") == []  # halves: invisible
        for r in (timer, level, due):
            assert await p.end_transaction(r, S.COMMIT) == "COMMITTED"
        assert await p.end_transaction(gone, S.ROLLBACK) == "ROLLED_BACK"
        await _delivered(broker, "d", [b"due"])  # its time had come: at its commit
        broker.advance(10)  # delay level 3
        await _delivered(broker, "d", [b"due", b"level"])
        broker.advance(3600)
        await _delivered(broker, "d", [b"at", b"due", b"level"])
        await anyio.sleep(0.2)
        assert b"rolled-back" not in broker.bodies("d")
        delivered = {m.body: m for m in broker.messages("d")}
        assert delivered[b"at"].msg_id == timer.msg_id  # the same message, on time
        with pytest.raises(BadRequest, match="timer_max_delay_s"):
            far = Message("d", b"x", deliver_at=datetime.now(UTC) + timedelta(days=30))
            await p.send_half(far, transaction_id="t5")


async def test_a_delayed_message_committed_by_the_check_back_waits_too(
    broker: InProcessBroker,
) -> None:
    class Committed:
        def check_local_transaction(self, msg: object) -> S:
            return S.COMMIT

    async with txmq.TransactionProducer(group="checked", listener=Committed()) as p:
        at = datetime.now(UTC) + timedelta(minutes=30)
        await p.send_half(Message("c", b"late", deliver_at=at), transaction_id="c1")
        with anyio.fail_after(10):
            while broker.pending_transactions():
                broker.check_back_now()
                await anyio.sleep(0.05)
        await anyio.sleep(0.2)
        assert broker.bodies("c") == []  # committed, waiting for its time
        broker.advance(1800)
        await _delivered(broker, "c", [b"late"])


async def test_a_timer_message_recalled_before_its_time_is_never_delivered(
    broker: InProcessBroker,
) -> None:
    at = datetime.now(UTC) + timedelta(hours=2)
    async with txmq.TransactionProducer(group="recaller") as p:
        plain = await p.send(Message("r", b"plain", deliver_at=at))
        half = await p.send_half(Message("r", b"in-a-tx", deliver_at=at), transaction_id="r1")
        await p.end_transaction(half, S.COMMIT)
        kept = await p.send(Message("r", b"kept", deliver_at=at))
        soon = await p.send(Message("r", b"soon", delay=timedelta(seconds=60)))
        for r in (plain, half):
            assert abs(await p.recall("r", r.msg_id) - at.timestamp() * 1000) < 2
        with pytest.raises(MessageNotFound, match="recalled already"):
            await p.recall("r", plain.msg_id)
        with pytest.raises(MessageNotFound, match="no timer message"):
            await p.recall("r", "0" * 32)
        broker.advance(60)
        await _delivered(broker, "r", [b"soon"])
        with pytest.raises(MessageNotFound, match="delivered already"):
            await p.recall("r", soon.msg_id)
        broker.advance(7200)
        await _delivered(broker, "r", [b"kept", b"soon"])
        assert kept.msg_id in {m.msg_id for m in broker.messages("r")}


async def test_a_recall_survives_a_sigkill_of_the_broker(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    """The recall is in the commit log: a broker killed after answering it and restarted
    on its store still does not deliver the recalled timer (a timer due with it is the
    witness that its time has passed)."""
    bp = broker_process("--flush", "sync").start()
    at = datetime.now(UTC) + timedelta(seconds=4)
    async with txmq.Producer(bp.address) as p:
        recalled = await p.send(Message("k", b"recalled", deliver_at=at))
        await p.send(Message("k", b"witness", deliver_at=at))
        await p.recall("k", recalled.msg_id)
    bp.kill()
    bp.start()
    async with txmq.PullConsumer(bp.address, "k-reader") as c:
        bodies: list[bytes] = []
        with anyio.fail_after(30):
            while b"witness" not in bodies:
                bodies = []
                for q in await c.queues("k"):
                    bodies += [m.body for m in (await c.pull("k", q, 0, long_poll=0)).messages]
                await anyio.sleep(0.1)
    assert bodies == [b"witness"]
