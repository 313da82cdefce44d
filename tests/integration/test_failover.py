"""Automatic failover on real processes: a name server with the controller inside, one
broker set of a SYNC_MASTER and two slaves, producers sending numbered messages through the
name server.  The master is SIGKILLed; a slave takes over within seconds, the old master
comes back as a slave (cutting a tail nobody else has), and afterwards every acknowledged
message is in the set's consume queues exactly once and the replicas' commit logs are
byte-identical up to the shortest."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from tests.conftest import wait_for
from tests.replicaset import ReplicaSet, Sender, consume_all, replica_sets
from tests.sqla_support import Order, create_all, orders
from txmq import Message
from txmq.sqla import COMMITTED, SqlTransactionChecker, transaction, transaction_log
from txmq.sync import AdminClient, TransactionProducer

__all__ = ["replica_sets"]  # the fixture

TOPIC = "jepsen"


@pytest.fixture
def replica_set(replica_sets: Callable[..., ReplicaSet]) -> Callable[..., ReplicaSet]:
    return replica_sets


def check_everything_acknowledged_is_there_once(rs: ReplicaSet, sender: Sender) -> int:
    """The replicas converge; their logs are byte-identical up to the shortest; every
    acknowledged number is in the consume queues exactly once (none is there twice)."""
    master = rs.wait_healthy()
    end = rs.runtime(master)[1]
    wait_for(lambda: all(rs.runtime(i)[1] == end for i in rs.brokers), timeout=60)
    assert {rs.runtime(i)[0] for i in rs.brokers} == {0}  # (retention deleted nothing)
    shortest = min(rs.runtime(i)[1] for i in rs.brokers)
    logs = {i: rs.log_bytes(i, shortest) for i in rs.brokers}
    assert len({len(b) for b in logs.values()}) == 1 and len(logs[master]) == shortest
    assert all(b == logs[master] for b in logs.values()), "the replicas' logs differ"
    seen = consume_all(rs.namesrv.address, TOPIC)
    twice = sorted(n for n, c in seen.items() if c > 1)
    missing = sorted(set(sender.acked) - set(seen))
    assert not twice, f"stored twice: {twice[:20]}"
    assert not missing, f"{len(missing)} acknowledged messages lost: {missing[:20]}"
    return len(seen)


def test_a_killed_master_is_replaced_and_rejoins_as_a_slave(
    replica_set: Callable[..., ReplicaSet],
) -> None:
    rs = replica_set("sync")
    first = rs.wait_healthy()
    sender = Sender(rs.namesrv.address, TOPIC).start()
    try:
        wait_for(lambda: sender.acked_count() >= 300, timeout=60)
        killed_at = time.monotonic()
        rs.kill(first)
        wait_for(lambda: sender.acked_since(killed_at), timeout=30)
        took = time.monotonic() - killed_at
        new = rs.master()
        assert new not in (-1, first)
        print(f"failover: first acknowledged send on broker {new} {took:.2f} s after the kill")
        rs.restart(first)
        assert rs.wait_healthy() == new  # the old master is a slave of the new one now
        before = sender.acked_count()
        wait_for(lambda: sender.acked_count() >= before + 300, timeout=60)
    finally:
        sender.stop()
    stored = check_everything_acknowledged_is_there_once(rs, sender)
    assert stored >= len(sender.acked) >= 600
    assert "now the SYNC_MASTER" in rs.brokers[new].output()


def test_a_transaction_whose_master_dies_before_its_commit_is_checked_back_by_the_new_one(
    replica_set: Callable[..., ReplicaSet], tmp_path: Path
) -> None:
    """The master is SIGKILLed between the half message and the COMMIT (inside the
    SQLAlchemy transaction block): the half was replicated, the new master finds it
    undecided, checks back with the producer group, and delivers it exactly once; the
    rolled-back one never."""
    rs = replica_set("sync", transaction_check_interval_s=0.5, transaction_timeout_s=1)
    engine = create_engine(f"sqlite:///{tmp_path / 'orders.db'}")
    with engine.begin() as conn:
        create_all(conn)
    checker = SqlTransactionChecker(engine)
    ns = rs.namesrv.address
    with TransactionProducer(
        namesrv=ns,
        group="orders-tx",
        listener=checker,
        heartbeat_interval=0.5,
        send_timeout=15.0,  # a send waits this long for the new master (CI runs 4 at once)
    ) as producer:
        producer.send(Message("orders-ha", b"warm-up"))  # (the topic and the route)
        first = rs.wait_healthy()
        with Session(engine) as session, transaction(producer, session) as tx:
            session.add(Order(id="o-1", amount=1))
            tx.send(Message("orders-ha", b"created", keys=["o-1"]))
            rs.kill(first)  # the half is stored (and copied); the COMMIT will find no master
        with pytest.raises(LookupError), Session(engine) as session:
            with transaction(producer, session) as tx2:
                session.add(Order(id="o-2", amount=2))
                tx2.send(Message("orders-ha", b"cancelled", keys=["o-2"]))
                raise LookupError("no stock")  # rolled back: nothing may be delivered
        new = rs.wait_healthy()
        assert new != first
        with AdminClient(namesrv=ns) as admin:
            wait_for(lambda: not admin.transactions("pending"), timeout=30)
        rs.restart(first)
        rs.wait_healthy()
    seen = consume_all(ns, "orders-ha", body=lambda b: b.decode())
    assert seen == {"warm-up": 1, "created": 1}  # exactly once; "cancelled" never
    with engine.connect() as conn:
        assert list(conn.execute(select(orders.c.id)).scalars()) == ["o-1"]
        state = select(transaction_log.c.state).where(
            transaction_log.c.transaction_id == tx.transaction_id
        )
        assert conn.execute(state).scalar() == COMMITTED
    assert "now the SYNC_MASTER" in rs.brokers[new].output()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_twenty_master_kills_lose_no_acknowledged_message(
    replica_set: Callable[..., ReplicaSet],
) -> None:
    """Jepsen-style: the master is SIGKILLed at a random moment 20 times, each time once
    the set is whole again, and started again (it rejoins as a slave)."""
    rng = random.Random(18)
    rs = replica_set("sync")
    sender = Sender(rs.namesrv.address, TOPIC).start()
    failovers: list[float] = []
    try:
        for _ in range(20):
            master = rs.wait_healthy()
            before = sender.acked_count()
            wait_for(lambda before=before: sender.acked_count() > before, timeout=60)  # type: ignore[misc]
            time.sleep(rng.uniform(0.0, 1.0))  # a random moment while messages flow
            killed_at = time.monotonic()
            rs.kill(master)
            wait_for(lambda t=killed_at: sender.acked_since(t), timeout=60)  # type: ignore[misc]
            failovers.append(time.monotonic() - killed_at)
            rs.restart(master)
    finally:
        sender.stop()
    stored = check_everything_acknowledged_is_there_once(rs, sender)
    failovers.sort()
    print(
        f"20 kills: {len(sender.acked)} acknowledged, {stored} stored, "
        f"{len(sender.unsafe)} answered not-yet-safe, {len(sender.failed)} failed; "
        f"failover p50 {failovers[len(failovers) // 2]:.2f} s, max {failovers[-1]:.2f} s"
    )
    assert len(sender.acked) > 1000
