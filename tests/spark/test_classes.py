"""Anomalies the classes hold per consumer group and per half message: a dead letter of one
group whatever the others did (issue 16, item 11), a rolled-back half beside a committed
one of the same transaction (item 12)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import anyio
import pytest

from tests.spark.conftest import Small
from txmq.client.producer import SendResult
from txmq.client.transaction import LocalTransactionState
from txmq.consumer.pull import PullConsumer
from txmq.protocol.message import Message
from txmq.protocol.wire import ConsumerSendMsgBack
from txmq.sqla.tables import consumed_keys, transaction_log
from txmq.sync import Producer, TransactionProducer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOPIC = "invoices"


def _dead_letter(address: str, group: str, sent: SendResult) -> None:
    """``group`` gives up on the message: the broker moves it to ``%DLQ%<group>``."""

    async def give_up() -> None:
        async with PullConsumer(address, group) as pc:
            got = await pc.pull(TOPIC, sent.queue_id, sent.queue_offset, max_msgs=1)
            msg = got.messages[0]
            assert msg.msg_id == sent.msg_id
            await pc.call(
                ConsumerSendMsgBack(
                    group=group,
                    commit_log_offset=msg.commit_log_offset,
                    delay_level=-1,
                    origin_msg_id=msg.msg_id,
                )
            )

    anyio.run(give_up)


def test_a_dead_letter_is_reported_for_its_group_whoever_else_consumed_it(
    small: Small,
) -> None:
    with Producer(small.address, "billing-app") as p:
        both = p.send(Message(TOPIC, b"{}", keys=["inv-1"]))  # audit consumed it
        alone = p.send(Message(TOPIC, b"{}", keys=["inv-2"]))  # nobody consumed it
        fine = p.send(Message(TOPIC, b"{}", keys=["inv-3"]))  # both consumed it
        redone = p.send(Message(TOPIC, b"{}", keys=["inv-4"]))  # billing consumed it later
    for sent in (both, alone, redone):
        _dead_letter(small.address, "billing", sent)
    # a group nobody expects, without a consumed key at all, gave up on one as well
    _dead_letter(small.address, "reports", fine)
    done = {"state": "done", "created_at": datetime.now(UTC)}
    for group, key in [("audit", "inv-1"), ("audit", "inv-3"), ("billing", "inv-3")]:
        small.insert(consumed_keys, consumer_group=group, key=key, **done)
    for group, key in [("audit", "inv-4"), ("billing", redone.msg_id)]:
        small.insert(consumed_keys, consumer_group=group, key=key, **done)

    found = small.reconcile(
        "--expect",
        f"billing={TOPIC}",
        "--expect",
        f"audit={TOPIC}",
        now=datetime.now(UTC) + timedelta(hours=1),
    )
    # billing gave up on the first two (and consumed the fourth since, by its id): two dead
    # letters of billing, none of them unconsumed by it
    assert found.pairs("dead_lettered") == {
        ("billing", both.msg_id),
        ("billing", alone.msg_id),
        ("reports", fine.msg_id),
    }, found.rows
    # audit, which did not give up, has not consumed the second yet
    assert found.pairs("unconsumed") == {("audit", alone.msg_id)}, found.rows
    assert fine.msg_id not in {m for _, m in found.pairs("unconsumed")}
    assert found.summary["counts"]["dead_lettered"] == 3


def test_each_half_of_a_committed_transaction_is_checked(small: Small) -> None:
    """One local transaction, committed, sent three messages; the broker committed the
    first, rolled the second back and never heard of the third: the second and the third
    are lost, though the transaction has a committed message."""
    tx = "multi-1"
    with TransactionProducer(small.address, "shop") as tp:
        halves = [
            tp.send_half(Message(TOPIC, b"{}", keys=[f"order-{i}"]), transaction_id=tx)
            for i in range(3)
        ]
        tp.end_transaction(halves[0], LocalTransactionState.COMMIT)
        tp.end_transaction(halves[1], LocalTransactionState.ROLLBACK)
        # a healthy one beside it: both halves committed
        for i in range(2):
            r = tp.send_half(Message(TOPIC, b"{}", keys=[f"fine-{i}"]), transaction_id="fine")
            tp.end_transaction(r, LocalTransactionState.COMMIT)
    committed = {"producer_group": "shop", "state": "COMMITTED", "created_at": datetime.now(UTC)}
    small.insert(transaction_log, transaction_id=tx, **committed)
    small.insert(transaction_log, transaction_id="fine", **committed)

    found = small.reconcile(now=datetime.now(UTC) + timedelta(hours=1))
    lost = {r["msg_id"]: r for r in found.rows["lost"]}
    assert set(lost) == {halves[1].msg_id, halves[2].msg_id}, found.rows["lost"]
    assert {r["transaction_id"] for r in lost.values()} == {tx}
    rolled_back, undecided = lost[halves[1].msg_id], lost[halves[2].msg_id]
    assert rolled_back["broker_state"] == "ROLLED_BACK"
    assert rolled_back["detail"] == (
        "the broker rolled the message back (another of the transaction committed)"
    )
    assert undecided["broker_state"] == "PENDING"
    assert found.summary["counts"]["lost"] == 2
    assert found.summary["facts"]["transactions"] == 2
