"""The official Apache RocketMQ 5 Python client against a real ``txmq broker start``
process through its gRPC endpoint: sends of every kind, SimpleConsumer and PushConsumer,
transactions with check-back over the Telemetry stream, retries and the DLQ."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from tests.conftest import ask, wait_for
from tests.grpc_support import (
    FilterExpression,
    GrpcBroker,
    Producer,
    PushConsumer,
    Recorder,
    SimpleConsumer,
    TransactionChecker,
    grpc_broker,
    make_message,
    receive_all,
    started,
)
from txmq.protocol.wire import GetTopicStats, UpdateSubscriptionGroup
from txmq.protocol.wire.errors import TopicNotFound

__all__ = ["grpc_broker"]

pytestmark = pytest.mark.timeout(180)


def test_send_and_receive_with_a_simple_consumer(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    with started(Producer(cfg, ("orders",))) as producer:
        receipts = [
            producer.send(
                make_message(
                    "orders",
                    f"order {i}".encode(),
                    tag="created" if i % 2 == 0 else "paid",
                    keys=f"order-{i}",
                    properties={"region": "eu", "n": str(i)},
                )
            )
            for i in range(10)
        ]
    assert len({r.message_id for r in receipts}) == 10
    sub = {"orders": FilterExpression("*")}
    with started(SimpleConsumer(cfg, "billing", sub, await_duration=2)) as consumer:
        got = receive_all(consumer, 10)
        assert consumer.receive(32, 15) == []  # all acked: nothing comes again
    assert sorted(m.message_id for m in got) == sorted(r.message_id for r in receipts)
    by_body = {m.body: m for m in got}
    m = by_body[b"order 3"]
    assert m.topic == "orders" and m.tag == "paid" and m.keys == {"order-3"}
    assert m.properties == {"region": "eu", "n": "3"}
    assert m.delivery_attempt == 1 and not m.corrupted
    stats = ask(gb.address, GetTopicStats(topic="orders"))
    assert sum(q.max_offset for q in stats.queues) == 10


def test_tag_filter(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    with started(Producer(cfg, ("events",))) as producer:
        for i in range(6):
            producer.send(make_message("events", b"e%d" % i, tag=("a", "b", "c")[i % 3]))
    sub = {"events": FilterExpression("a || c")}
    with started(SimpleConsumer(cfg, "picky", sub, await_duration=2)) as consumer:
        got = receive_all(consumer, 4)
        assert consumer.receive(32, 15) == []
    assert sorted(m.body for m in got) == [b"e0", b"e2", b"e3", b"e5"]


def test_delayed_messages_arrive_on_time(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    sub = {"later": FilterExpression("*")}
    arrived: dict[bytes, float] = {}
    with (
        started(SimpleConsumer(cfg, "waiter", sub, await_duration=5)) as consumer,
        started(Producer(cfg, ("later",))) as producer,
    ):
        due = {}
        now = time.time()
        for name, delay in ((b"d1", 1.5), (b"d2", 3.7), (b"d3", 6.2)):
            due[name] = now + delay
            producer.send(make_message("later", name, delivery_timestamp=int(due[name] * 1000)))
        deadline = time.monotonic() + 30
        while len(arrived) < 3 and time.monotonic() < deadline:
            for m in consumer.receive(32, 15):
                arrived[m.body] = time.time()
                consumer.ack(m)
    assert set(arrived) == {b"d1", b"d2", b"d3"}
    for name, at in arrived.items():
        assert abs(at - due[name]) <= 1.0, (name, at - due[name])


class Checker(TransactionChecker):  # type: ignore[misc]
    def __init__(self, answers: dict[bytes, Any]) -> None:
        self.answers = answers
        self.checked: list[bytes] = []

    def check(self, message: Any) -> Any:
        self.checked.append(message.body)
        return self.answers[message.body]


def test_transactions_commit_rollback_and_check_back(grpc_broker: Any) -> None:
    from rocketmq.grpc_protocol import TransactionResolution

    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    checker = Checker(
        {
            b"undecided-yes": TransactionResolution.COMMIT,
            b"undecided-no": TransactionResolution.ROLLBACK,
        }
    )
    with started(Producer(cfg, ("payments",), checker)) as producer:
        for body, end in (
            (b"committed", "commit"),
            (b"rolled-back", "rollback"),
            (b"undecided-yes", None),
            (b"undecided-no", None),
        ):
            tx = producer.begin_transaction()
            producer.send(make_message("payments", body), tx)
            if end == "commit":
                tx.commit()
            elif end == "rollback":
                tx.rollback()
        sub = {"payments": FilterExpression("*")}
        with started(SimpleConsumer(cfg, "ledger", sub, await_duration=2)) as consumer:
            got = receive_all(consumer, 2, timeout=40)
            # the rolled-back and the rejected halves never come
            assert consumer.receive(32, 15) == []
    assert sorted(m.body for m in got) == [b"committed", b"undecided-yes"]
    # the broker asked about each undecided half (over the Telemetry stream) once it was
    # past its immunity, and about nothing else
    assert sorted(set(checker.checked)) == [b"undecided-no", b"undecided-yes"]
    assert gb.process.alive()


def test_a_failed_message_is_retried_then_dead_lettered(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    with started(Producer(cfg, ("jobs",))) as producer:
        producer.send(make_message("jobs", b"poison"))
        producer.send(make_message("jobs", b"fine"))
    sub = {"jobs": FilterExpression("*")}
    attempts: list[int] = []
    with started(SimpleConsumer(cfg, "workers", sub, await_duration=2)) as consumer:
        deadline = time.monotonic() + 90
        fine = 0
        # never ack "poison": each invisible time (1 s) runs out and it comes again, until
        # the retry policy's attempts (16 retries + 1) are used up
        while time.monotonic() < deadline and len(attempts) < 17:
            for m in consumer.receive(32, 1):
                if m.body == b"poison":
                    attempts.append(m.delivery_attempt)
                else:
                    fine += 1
                    consumer.ack(m)
        assert fine == 1
        assert attempts == list(range(1, 18))

        wait_for(lambda: dlq_count(gb, "workers") == 1, 20)
        assert consumer.receive(32, 1) == []


def dlq_count(gb: GrpcBroker, group: str) -> int:
    try:
        stats = ask(gb.address, GetTopicStats(topic=f"%DLQ%{group}"))
    except TopicNotFound:  # nothing dead-lettered yet
        return 0
    return sum(q.max_offset - q.min_offset for q in stats.queues)


def test_push_consumer_retries_a_failed_message(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    failed_once: set[str] = set()

    def fail(m: Any) -> bool:
        if m.body == b"m7" and m.message_id not in failed_once:
            failed_once.add(m.message_id)
            return True
        return False

    rec = Recorder(fail=fail)
    with started(Producer(cfg, ("tasks",))) as producer:
        sent = [producer.send(make_message("tasks", b"m%d" % i)).message_id for i in range(50)]
    sub = {"tasks": FilterExpression("*")}
    with started(PushConsumer(cfg, "pushers", rec, sub)):
        rec.wait(51, timeout=60)
    counts = Counter(mid for mid, _, _, _ in rec.got)
    assert set(counts) == set(sent)
    assert [c for c in counts.values() if c != 1] == [2]  # m7: failed once, then done
    retried = [a for mid, b, a, _ in rec.got if b == b"m7"]
    assert retried == [1, 2]


def fifo_group(gb: GrpcBroker, group: str, retries: int | None = None) -> None:
    row = ask(gb.address, UpdateSubscriptionGroup(group=group, fifo=True, retry_max_times=retries))
    assert row.fifo


def test_fifo_order_per_message_group(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    fifo_group(gb, "fifo-readers")
    groups = ("alpha", "beta", "gamma")
    with started(Producer(cfg, ("fifo",))) as producer:
        for i in range(1000):
            for g in groups:
                producer.send(make_message("fifo", f"{g}:{i}".encode(), message_group=g))
    sub = {"fifo": FilterExpression("*")}
    seen: dict[str, list[int]] = {g: [] for g in groups}
    with started(SimpleConsumer(cfg, "fifo-readers", sub, await_duration=2)) as consumer:
        deadline = time.monotonic() + 120
        total = 0
        while total < 3000:
            assert time.monotonic() < deadline, f"received {total} of 3000"
            batch = consumer.receive(32, 20)
            for m in batch:
                group, _, n = m.body.decode().partition(":")
                assert m.message_group == group
                seen[group].append(int(n))
            for m in batch:
                consumer.ack(m)
            total += len(batch)
        assert consumer.receive(32, 20) == []
    for g in groups:
        assert seen[g] == list(range(1000)), g  # each group in order, each message once


def test_fifo_redelivers_in_place_and_holds_the_rest_back(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    fifo_group(gb, "strict")
    with started(Producer(cfg, ("steps",))) as producer:
        for i in range(3):
            producer.send(make_message("steps", b"step %d" % i, message_group="order-1"))
    sub = {"steps": FilterExpression("*")}
    order: list[tuple[bytes, int]] = []
    with started(SimpleConsumer(cfg, "strict", sub, await_duration=2)) as consumer:
        deadline = time.monotonic() + 60
        while len(order) < 4:
            assert time.monotonic() < deadline, order
            for m in consumer.receive(1, 1):
                order.append((m.body, m.delivery_attempt))
                if (m.body, m.delivery_attempt) != (b"step 0", 1):
                    consumer.ack(m)  # step 0 is left to expire once
    # step 1 did not come before step 0 was done: the first delivery expired and came again
    assert order == [(b"step 0", 1), (b"step 0", 2), (b"step 1", 1), (b"step 2", 1)]


def test_push_consumer_fifo(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    cfg = gb.config()
    fifo_group(gb, "fifo-push")
    flaky = {b"b:5"}

    def fail(m: Any) -> bool:  # b:5 fails once (the FIFO client retries it in place)
        if m.body in flaky:
            flaky.discard(m.body)
            return True
        return False

    rec = Recorder(fail=fail)
    with started(Producer(cfg, ("fifo-push",))) as producer:
        for i in range(50):
            for g in ("a", "b"):
                producer.send(make_message("fifo-push", f"{g}:{i}".encode(), message_group=g))
    sub = {"fifo-push": FilterExpression("*")}
    with started(PushConsumer(cfg, "fifo-push", rec, sub)):
        rec.wait(101, timeout=90)
    for g in ("a", "b"):
        bodies = [b.decode() for b in rec.bodies() if b.decode().startswith(g)]
        want = [f"{g}:{i}" for i in range(50)]
        if g == "b":  # the failed one is consumed again before anything after it
            want.insert(6, "b:5")
        assert bodies == want, g
