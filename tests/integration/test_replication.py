"""A broker set of a master and slaves: the slaves' commit logs are byte-identical copies,
their consume queues serve pulls, SYNC_MASTER acknowledges only what a slave has (and says
when none could copy it), slaves refuse writes, and metadata reaches them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import pytest

from tests.conftest import wait_for
from txmq import Message
from txmq.broker.server import Broker, EmbeddedBroker
from txmq.broker.store.commitlog import segment_paths
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.wire.errors import NotMaster
from txmq.sync import AdminClient, Producer, PullConsumer, TransactionProducer

Start = Callable[..., EmbeddedBroker]


def _b(e: EmbeddedBroker) -> Broker:
    assert e.broker is not None
    return e.broker


def _log(e: EmbeddedBroker) -> bytes:
    return b"".join(p.read_bytes() for p in segment_paths(e.config.store / "commitlog"))


def _caught_up(master: EmbeddedBroker, *slaves: EmbeddedBroker) -> None:
    end = _b(master).store.commit_log_max_offset
    wait_for(lambda: all(_b(s).store.commit_log_max_offset == end for s in slaves))


def _set(start: Start, n_slaves: int, **master: object) -> list[EmbeddedBroker]:
    m = start(broker_id=0, segment_size=128 * 1024, max_message_size=64 * 1024, **master)
    ha = _b(m).replication.ha_address
    slaves = [
        start(
            broker_id=i, segment_size=128 * 1024, max_message_size=64 * 1024, ha_master_address=ha
        )
        for i in range(1, n_slaves + 1)
    ]
    for s in slaves:
        wait_for(lambda s=s: _b(s).replication.client.connected)  # type: ignore[misc]
    wait_for(lambda: len(_b(m).replication.service.slaves) == n_slaves)
    return [m, *slaves]


def test_sync_master_and_two_slaves_hold_the_same_log(embedded_broker: Start) -> None:
    master, s1, s2 = _set(embedded_broker, 2, replication="sync")
    with Producer(master.address) as producer:
        results = [
            producer.send(Message("orders", f"m{i}".encode() * (i % 50 + 1), keys=[f"k{i}"]))
            for i in range(1500)  # over several 128 KiB segments: blanks replicate too
        ]
    assert {r.status for r in results} == {"SEND_OK"}
    # SYNC_MASTER: acknowledged means a slave had it at that moment
    last_end = _b(master).store.commit_log_max_offset
    assert max(_b(s).replication.client.store.commit_log_max_offset for s in (s1, s2)) > 0
    _caught_up(master, s1, s2)
    assert len(segment_paths(master.config.store / "commitlog")) >= 3
    assert _log(s1) == _log(master) == _log(s2)
    assert _b(s1).store.commit_log_max_offset == last_end
    for slave in (s1, s2):  # a slave's own consume queues serve pulls
        wait_for(lambda slave=slave: _b(slave).topics.get("orders"))  # type: ignore[misc]
        with PullConsumer(slave.address, group="g") as consumer:
            got = []
            for q in range(4):
                offset = 0
                while True:
                    res = consumer.pull("orders", q, offset, max_msgs=256, long_poll=0)
                    if not res.messages:
                        break
                    got.extend(m.body for m in res.messages)
                    offset = res.next_offset
        assert sorted(got) == sorted(f"m{i}".encode() * (i % 50 + 1) for i in range(1500))


def test_sync_master_without_a_slave_says_so_and_a_slave_refuses_writes(
    embedded_broker: Start,
) -> None:
    master = embedded_broker(broker_id=0, replication="sync", sync_replication_timeout_s=0.5)
    with Producer(master.address) as producer:
        r = producer.send(Message("t", b"alone"))
        assert r.status == "SLAVE_NOT_AVAILABLE"  # stored, but on one machine only
    slave = embedded_broker(broker_id=1, ha_master_address=_b(master).replication.ha_address)
    wait_for(lambda: _b(master).replication.service.slaves)
    with Producer(master.address) as producer:
        assert producer.send(Message("t", b"copied")).status == "SEND_OK"
    wait_for(lambda: _b(slave).topics.get("t") is not None)  # (metadata copied)
    with Producer(slave.address, retry_times=0) as producer, pytest.raises(NotMaster):
        producer.send(Message("t", b"to the slave"))
    _caught_up(master, slave)
    assert _log(slave) == _log(master)


def test_a_half_message_not_yet_on_a_slave_does_not_run_its_local_transaction(
    embedded_broker: Start,
) -> None:
    master = embedded_broker(broker_id=0, replication="sync")
    ran: list[str] = []

    class Listener:
        def execute_local_transaction(self, msg: Message, arg: object) -> LocalTransactionState:
            ran.append(msg.body.decode())
            return LocalTransactionState.COMMIT

        def check_local_transaction(self, msg: object) -> LocalTransactionState:
            return LocalTransactionState.ROLLBACK

    with TransactionProducer(master.address, group="tx", listener=Listener()) as producer:
        sent = producer.send_message_in_transaction(Message("t", b"unsafe"))
        assert sent.send_result.status == "SLAVE_NOT_AVAILABLE"
        assert sent.local_state is LocalTransactionState.ROLLBACK and ran == []


def test_metadata_reaches_the_slaves(embedded_broker: Start) -> None:
    master, slave = _set(embedded_broker, 1, ha_metadata_sync_interval_s=0.2)
    with AdminClient(master.address) as admin:
        admin.create_topic("billing", 6)
    with Producer(master.address) as producer:
        for i in range(20):
            producer.send(Message("billing", b"x"), queue_id=i % 6)
    with PullConsumer(master.address, group="billers") as consumer:
        consumer.commit_offset("billing", 3, 2)
    wait_for(lambda: (t := _b(slave).topics.get("billing")) is not None and t.queue_nums == 6)
    wait_for(lambda: _b(slave).offsets.query("billers", "billing", 3) == 2)


def test_a_slave_stopped_and_started_again_catches_up(
    embedded_broker: Start, tmp_path: Path
) -> None:
    master, slave = _set(embedded_broker, 1, replication="sync")
    store = slave.config.store
    with Producer(master.address) as producer:
        for i in range(100):
            producer.send(Message("t", f"a{i}".encode()))
        slave.stop()
        for i in range(100):
            assert producer.send(Message("t", f"b{i}".encode())).status == "SLAVE_NOT_AVAILABLE"
        again = embedded_broker(
            broker_id=1, store=store, ha_master_address=_b(master).replication.ha_address
        )
        _caught_up(master, again)
        assert producer.send(Message("t", b"c")).status == "SEND_OK"
    _caught_up(master, again)
    assert _log(again) == _log(master)


def test_a_promotion_handed_on_before_its_duties_start_ends_quietly(
    embedded_broker: Callable[..., EmbeddedBroker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker told to step down (or to stop) while it is being promoted cancels the
    master's duties before they have started: the promotion ends, no error (it ended the
    broker with "Child exited without calling task_status.started()" in a CI run)."""
    b = embedded_broker()
    broker, loop = b.broker, b.loop
    assert broker is not None and loop is not None
    starting = asyncio.Event()  # (made here, used on the broker's loop only)

    async def slow_schedule(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        starting.set()
        await anyio.sleep_forever()  # never says it started

    async def scenario() -> None:
        await broker.became_slave()  # the duties of the master it started as
        monkeypatch.setattr(broker.schedule, "run", slow_schedule)
        promotion = asyncio.ensure_future(broker._start_duties())
        await asyncio.wait_for(starting.wait(), 10)
        await broker.became_slave()  # handed on mid-promotion
        await asyncio.wait_for(promotion, 10)

    asyncio.run_coroutine_threadsafe(scenario(), loop).result(20)
