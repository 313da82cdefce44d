"""Faults in a cluster of real processes (two name servers, two broker sets), with
PostgreSQL: a broker SIGKILLed while 10,000 messages flow loses no acknowledged message and
idempotent consumers apply each exactly once; transactions with SqlTransactionChecker end
on the broker set that stored their half, lost endings resolved by its check-back; orderly
consumers never run one queue twice at once."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import txmq
from tests.conftest import BrokerProcess, NamesrvProcess, ask, wait_for
from tests.integration.test_cluster_clients import _routed, _stop
from tests.integration.test_sqla_transactions import LosingEnds
from tests.outbox_support import Db, effects, make_db, until
from tests.sqla_support import Order, create_all
from txmq import Message, MessageExt, outbox
from txmq.client.producer import SendResult
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import Prop
from txmq.protocol.wire import UpdateAndCreateTopic
from txmq.protocol.wire.errors import TxmqError
from txmq.sqla import SqlTransactionChecker, transaction
from txmq.sync import Producer, PullConsumer, PushConsumer

NamesrvFactory = Callable[..., NamesrvProcess]
BrokerFactory = Callable[..., BrokerProcess]

#: quick check-backs: a round every 0.2 s, a half message checked once 0.5 s old
FAST = {
    "TXMQ_BROKER_TRANSACTION_CHECK_INTERVAL_S": "0.2",
    "TXMQ_BROKER_TRANSACTION_TIMEOUT_S": "0.5",
}


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Db]:
    with make_db("postgresql", tmp_path) as db:
        yield db


def _cluster(
    namesrv_process: NamesrvFactory,
    cluster_broker: BrokerFactory,
    topic: str,
    queues: int,
    env: dict[str, str] | None = None,
) -> tuple[list[NamesrvProcess], list[BrokerProcess], str]:
    names = [namesrv_process(f"ns{i}").start() for i in range(2)]
    addrs = [ns.address for ns in names]
    brokers = [cluster_broker(f"broker-{c}", addrs, env=env).start() for c in "ab"]
    for bp in brokers:
        ask(bp.address, UpdateAndCreateTopic(topic=topic, queue_nums=queues))
    _routed(names, topic, 2)
    return names, brokers, ";".join(addrs)


# its own waits allow up to 480 s (a slow machine takes ~3 min; a quiet one ~1)
@pytest.mark.timeout(480)
def test_a_broker_killed_while_10000_messages_flow_loses_nothing_applied_once(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory, pg: Db
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker, "flow", 4)
    total = 10_000

    @txmq.idempotent(pg.engine, group="flow-effects")
    def apply(msg: MessageExt, session: Session) -> None:
        session.execute(insert(effects).values(key=msg.keys[0], body=msg.body.decode()))

    members = [
        PushConsumer(namesrv=namesrv, group="flow-g", listener=apply,
                     consume_from="FIRST_OFFSET", instance_name=f"m{i}")
        for i in range(2)
    ]  # fmt: skip
    # an orderly group on the same flow: never two copies of one queue at once, even while
    # broker-b (its queues and their locks) is gone and back
    running: Counter[tuple[str, int]] = Counter()
    overlaps: list[tuple[str, int]] = []
    in_order: set[str] = set()
    orderly_lock = threading.Lock()

    def one_at_a_time(msg: MessageExt) -> None:
        queue = (msg.broker_name, msg.queue_id)
        with orderly_lock:
            running[queue] += 1
            if running[queue] > 1:
                overlaps.append(queue)
        time.sleep(0.0005)
        with orderly_lock:
            running[queue] -= 1
            in_order.add(msg.keys[0])

    orderly = [
        PushConsumer(namesrv=namesrv, group="flow-o", listener=one_at_a_time, orderly=True,
                     consume_from="FIRST_OFFSET", instance_name=f"o{i}",
                     rebalance_interval=1.0, lock_renew_interval=1.0, lock_max_live=3.0)
        for i in range(2)
    ]  # fmt: skip
    for m in [*members, *orderly]:
        m.subscribe("flow")
    acked: list[str] = []
    failed: list[BaseException] = []
    lock = threading.Lock()
    rng = random.Random(16)
    kill_at, restart_at = rng.randint(2000, 4000), rng.randint(6000, 8000)

    def send(worker: int, producer: Producer) -> None:
        for i in range(worker, total, 4):
            key = f"k{i}"
            try:
                producer.send(Message("flow", b"%d" % i, keys=[key]))
            except TxmqError as exc:  # not acknowledged: may or may not have been stored
                with lock:
                    failed.append(exc)
                continue
            with lock:
                acked.append(key)

    with (
        members[0],
        members[1],
        orderly[0],
        orderly[1],
        Producer(namesrv=namesrv, send_timeout=5) as producer,
    ):
        threads = [threading.Thread(target=send, args=(w, producer)) for w in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: len(acked) >= kill_at, timeout=120)
        brokers[1].kill()
        killed_at = len(acked)
        wait_for(lambda: len(acked) >= restart_at, timeout=120)
        brokers[1].start()  # the same store: what it acknowledged comes back
        for t in threads:
            t.join(300)
        wanted = set(acked)

        def all_applied() -> bool:
            return wanted <= {k for k, _ in pg.effects()}

        wait_for(all_applied, timeout=180, interval=0.5)
        wait_for(lambda: wanted <= in_order, timeout=60, interval=0.2)
    applied = Counter(k for k, _ in pg.effects())
    twice = [k for k, n in applied.items() if n > 1]
    print(
        f"{len(acked)} acknowledged of {total} ({len(failed)} sends failed), broker-b killed "
        f"after {killed_at}; {len(applied)} applied, {len(twice)} twice"
    )
    assert twice == []
    # every send acknowledged: one that met the dead broker set was retried on the other
    # within its budget (retry_times=2, the dead set left out); RequestTimeout,
    # BrokerUnavailable and NOT_MASTER are all retriable, so none may surface
    assert failed == [], failed[:5]
    assert len(acked) == total
    assert wanted <= set(applied)
    assert overlaps == []
    _stop(names, brokers)


class EndsRecorded(txmq.TransactionProducer):
    """A transactional producer that records the broker's answer to each END_TRANSACTION
    (or the error)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ends: list[tuple[str, str, str]] = []  # (message id, broker set, answer)

    async def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState | str,
        *,
        from_check: bool = False,
        wait: bool = True,
    ) -> str:
        # waits for every answer, even where the caller would not: they are what it records
        try:
            answer = await super().end_transaction(result, state, from_check=from_check)
        except TxmqError as exc:
            self.ends.append((result.msg_id, result.broker_name, f"{type(exc).__name__}: {exc}"))
            raise
        self.ends.append((result.msg_id, result.broker_name, answer))
        return answer


class CountedChecks:
    """A listener that counts the check-backs reaching it (by transaction id) and answers
    them with ``checker``."""

    def __init__(self, checker: SqlTransactionChecker) -> None:
        self.checker = checker
        self.checked: Counter[str] = Counter()

    def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
        return self.checker.execute_local_transaction(msg, arg)

    async def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        self.checked[msg.get_property(Prop.TRANSACTION_ID) or ""] += 1
        return await self.checker.check_local_transaction(msg)


def test_transactions_end_on_the_broker_set_of_their_half_and_check_backs_resolve_them(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory, pg: Db
) -> None:
    # a half is checked back once 2 s old: time enough for any normal ending to arrive
    # first, so a check-back of a transaction that was ended says its END went astray
    env = {**FAST, "TXMQ_BROKER_TRANSACTION_TIMEOUT_S": "2"}
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker, "orders-c", 2, env)
    with pg.engine.begin() as conn:
        create_all(conn)
    aengine = create_async_engine(pg.aurl)
    seen: list[MessageExt] = []
    consumer = PushConsumer(namesrv=namesrv, group="orders-c-g", listener=seen.append,
                            consume_from="FIRST_OFFSET")  # fmt: skip
    consumer.subscribe("orders-c")
    checks = CountedChecks(SqlTransactionChecker(aengine))
    ended: dict[str, SendResult] = {}  # transaction id -> its half

    async def run() -> None:
        async with EndsRecorded(namesrv=namesrv, group="orders-c-tx",
                                listener=checks) as producer:  # fmt: skip
            for i in range(20):
                async with AsyncSession(aengine) as session, transaction(producer, session) as tx:
                    session.add(Order(id=f"c-{i}", amount=i))
                    await tx.send(Message("orders-c", b"created", keys=[f"c-{i}"]))
                ended[tx.transaction_id] = tx.results[0]
            # each END_TRANSACTION answered COMMITTED by the broker set that stored its half
            assert {r.broker_name for r in ended.values()} == {"broker-a", "broker-b"}
            assert sorted(producer.ends) == sorted(
                (r.msg_id, r.broker_name, "COMMITTED") for r in ended.values()
            )
            # none left pending on any broker (and, below, none was checked back)
            await until(lambda: _none_pending(brokers), timeout=30)
        # endings that never reach the broker: each broker set checks back its own halves
        async with LosingEnds(namesrv=namesrv, group="orders-c-tx", listener=checks) as losing:
            for i in range(20, 26):
                async with AsyncSession(aengine) as session, transaction(losing, session) as tx:
                    session.add(Order(id=f"c-{i}", amount=i))
                    await tx.send(Message("orders-c", b"created", keys=[f"c-{i}"]))
            await until(lambda: _none_pending(brokers), timeout=60)
        await aengine.dispose()

    with consumer:
        anyio.run(run)
        wait_for(lambda: len(seen) == 26, timeout=60)
    # no check-back for a transaction ended normally; each lost ending checked back
    assert not set(checks.checked) & set(ended), checks.checked
    assert len(checks.checked) == 6
    assert sorted(m.keys[0] for m in seen) == sorted(f"c-{i}" for i in range(26))
    assert {m.broker_name for m in seen} == {"broker-a", "broker-b"}
    _stop(names, brokers)


async def _none_pending(brokers: list[BrokerProcess]) -> bool:
    for bp in brokers:
        async with txmq.AdminClient(bp.address) as admin:
            if await admin.transactions():
                return False
    return True


def test_orderly_consumers_never_run_one_queue_twice_at_once(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker, "ordered", 2)
    running: Counter[tuple[str, int]] = Counter()
    overlaps: list[tuple[str, int]] = []
    got: dict[str, list[int]] = {}
    lock = threading.Lock()

    def listener(msg: MessageExt) -> None:
        queue = (msg.broker_name, msg.queue_id)
        with lock:
            running[queue] += 1
            if running[queue] > 1:
                overlaps.append(queue)
            got.setdefault(msg.keys[0], []).append(int(msg.body))
        time.sleep(0.002)
        with lock:
            running[queue] -= 1

    members = [
        PushConsumer(namesrv=namesrv, group="ordered-g", listener=listener, orderly=True,
                     consume_from="FIRST_OFFSET", instance_name=f"o{i}",
                     rebalance_interval=1.0, lock_renew_interval=1.0, lock_max_live=3.0)
        for i in range(3)
    ]  # fmt: skip
    for m in members:
        m.subscribe("ordered")
    with Producer(namesrv=namesrv) as producer:
        for seq in range(60):
            for k in range(10):
                producer.send(Message("ordered", b"%d" % seq, keys=[f"key{k}"]),
                              sharding_key=f"key{k}")  # fmt: skip

    def unique() -> int:
        with lock:
            return sum(len(set(v)) for v in got.values())

    with members[0], members[1]:
        wait_for(lambda: unique() >= 150, timeout=60)
        with members[2]:  # a third member joins mid-stream: queues move between members
            wait_for(lambda: unique() >= 300, timeout=60)
            # broker-b (its queues and their locks) SIGKILLed mid-stream, then back
            brokers[1].kill()
            wait_for(lambda: unique() >= 330, timeout=60)
            brokers[1].start()
            wait_for(lambda: unique() == 600, timeout=120)
    assert overlaps == []
    for key, seqs in got.items():
        firsts = list(dict.fromkeys(seqs))  # a moved queue may redeliver: at least once
        assert firsts == list(range(60)), key
    _stop(names, brokers)


def test_the_outbox_relay_sends_through_name_servers_each_key_in_order(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory, pg: Db
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker, "outbox-c", 2)
    keys, per_key = 12, 25
    for seq in range(per_key):
        with Session(pg.engine) as session, session.begin():
            for k in range(keys):
                outbox.add(session, Message("outbox-c", b"%d" % seq), sharding_key=f"key{k}")

    async def relay() -> None:
        async with outbox.OutboxRelay(pg.aurl, namesrv=namesrv, poll_interval=0.05):
            await until(lambda: pg.count(state="sent") == keys * per_key, timeout=60)

    anyio.run(relay)
    stored: dict[str, list[str]] = {}
    brokers_of_key: dict[str, set[str]] = {}
    with PullConsumer(namesrv=namesrv) as pc:
        for q in pc.message_queues("outbox-c"):
            offset = 0
            while True:
                got = pc.pull(q.topic, q.queue_id, offset, long_poll=0, broker_name=q.broker_name)
                if not got.messages:
                    break
                for m in got.messages:
                    key = m.get_property("SHARDING_KEY") or ""
                    stored.setdefault(key, []).append(m.body.decode())
                    brokers_of_key.setdefault(key, set()).add(q.broker_name)
                offset = got.next_offset
    assert sorted(stored) == sorted(f"key{k}" for k in range(keys))
    for key, bodies in stored.items():
        assert list(dict.fromkeys(bodies)) == [str(i) for i in range(per_key)], key
        assert len(brokers_of_key[key]) == 1  # one queue of the whole route per key
    assert {b for bs in brokers_of_key.values() for b in bs} == {"broker-a", "broker-b"}
    _stop(names, brokers)
