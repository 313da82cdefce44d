"""txmq.sqla.transaction with a real broker and real databases (PostgreSQL and SQLite):
a consumer sees a message only after the database commit; a failed block leaves no rows
and no message; a lost ending is resolved exactly by the check-back from the log."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, sessionmaker

from tests.conftest import wait_for
from tests.sqla_support import TRANSPORTS, Order, Via, create_all, orders, pg_schema, start_broker
from txmq import AdminClient, ConsumeFrom, Message, MessageExt, PushConsumer, TransactionProducer
from txmq import sync as txsync
from txmq.broker.server import EmbeddedBroker
from txmq.client.producer import SendResult
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.wire import TransactionRow
from txmq.protocol.wire.errors import BrokerUnavailable
from txmq.sqla import COMMITTED, ROLLED_BACK, SqlTransactionChecker, transaction, transaction_log

pytestmark = pytest.mark.anyio

#: quick check-backs: a round every 0.1 s, a half message checked once 0.3 s old
FAST = {"transaction_check_interval_s": 0.1, "transaction_timeout_s": 0.3}


@dataclass
class Db:
    url: str
    aurl: str
    engine: Engine
    aengine: AsyncEngine

    def order_ids(self) -> list[str]:
        with self.engine.connect() as conn:
            return sorted(conn.execute(select(orders.c.id)).scalars())

    def log_state(self, tid: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(
                select(transaction_log.c.state).where(transaction_log.c.transaction_id == tid)
            ).scalar()


@contextmanager
def _urls(backend: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    if backend == "sqlite":
        path = tmp_path / "app.db"
        yield f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}"
    else:
        with pg_schema() as url:
            yield url, url


@pytest.fixture(params=["postgresql", "sqlite"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Db]:
    with _urls(request.param, tmp_path) as (url, aurl):
        engine = create_engine(url)
        with engine.begin() as conn:
            create_all(conn)
        aengine = create_async_engine(aurl)
        try:
            yield Db(url, aurl, engine, aengine)
        finally:
            await aengine.dispose()
            engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def sync_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    with _urls(request.param, tmp_path) as (url, aurl):
        engine = create_engine(url)
        with engine.begin() as conn:
            create_all(conn)
        try:
            yield Db(url, aurl, engine, create_async_engine(aurl))  # the async one stays unused
        finally:
            engine.dispose()


@dataclass
class Seen:
    """What a consumer received, and whether the order row was committed by then."""

    messages: list[MessageExt] = field(default_factory=list)
    committed_when_seen: list[bool] = field(default_factory=list)


@contextmanager
def _noop() -> Iterator[None]:
    yield


async def consume(
    address: str, topic: str, db: Db, seen: Seen, via: Via | None = None
) -> PushConsumer:
    def on_message(msg: MessageExt) -> None:  # runs in a worker thread
        order_id = msg.keys[0]
        seen.committed_when_seen.append(order_id in db.order_ids())
        seen.messages.append(msg)

    async with AdminClient(address) as admin:
        await admin.create_topic(topic, 4)  # so that the consumer's first rebalance finds it
    consumer = PushConsumer(
        via.address if via else address,
        f"{topic}-readers",
        listener=on_message,
        consume_from=ConsumeFrom.FIRST_OFFSET,
        **(via.kw if via else {}),
    )
    consumer.subscribe(topic)
    await consumer.start()
    return consumer


async def pending(address: str) -> list[TransactionRow]:
    async with AdminClient(address) as admin:
        return await admin.transactions("pending")


async def none_pending(address: str) -> bool:
    """Whether the broker holds no pending half: what a transaction's end leaves — sent
    without waiting for the broker's answer (as RocketMQ's endTransactionOneway), so
    polled for, not read once right after the block."""
    return await pending(address) == []


async def until(predicate: Callable[[], Any], timeout: float = 20.0) -> None:
    with anyio.fail_after(timeout):
        while not await predicate():  # noqa: ASYNC110
            await anyio.sleep(0.05)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_commit_is_consumed_only_after_the_database_commit(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker], transport: str
) -> None:
    via = start_broker(embedded_broker, transport)
    b = via.broker
    seen = Seen()
    checker = SqlTransactionChecker(db.aengine)
    # RocketMQ 5's protocol has no transactional FIFO messages: no sharding key over gRPC
    key: dict[str, Any] = {"sharding_key": "o-1"} if transport == "txmq" else {}
    async with TransactionProducer(
        via.address, "orders-tx", listener=checker, **via.kw
    ) as producer:
        consumer = await consume(b.address, "orders", db, seen, via)
        try:
            async with AsyncSession(db.aengine) as session:
                async with transaction(producer, session) as tx:
                    session.add(Order(id="o-1", amount=10))
                    await tx.send(Message("orders", b"created", keys=["o-1"]), **key)
                    await tx.send(Message("orders", b"paid", keys=["o-1"]), **key)
                    await anyio.sleep(0.5)  # a consumer would have had time to see it
                    assert seen.messages == []
                    assert db.order_ids() == []
            assert tx.state is LocalTransactionState.COMMIT

            async def both_seen() -> bool:
                return len(seen.messages) == 2

            await until(both_seen)
        finally:
            await consumer.stop()
    if transport == "txmq":
        in_queue = sorted(seen.messages, key=lambda m: m.queue_offset)
        assert [m.body for m in in_queue] == [b"created", b"paid"]  # committed in send order
        assert len({m.queue_id for m in in_queue}) == 1  # one sharding key, one queue
    else:
        assert sorted(m.body for m in seen.messages) == [b"created", b"paid"]
    assert seen.committed_when_seen == [True, True]
    assert {m.msg_id for m in seen.messages} == {r.msg_id for r in tx.results}
    assert db.log_state(tx.transaction_id) == COMMITTED
    await until(lambda: none_pending(b.address))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_exception_leaves_no_rows_and_no_message(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker], transport: str
) -> None:
    via = start_broker(embedded_broker, transport, **FAST)
    b = via.broker
    seen = Seen()
    checker = SqlTransactionChecker(db.aengine)
    async with TransactionProducer(
        via.address, "orders-tx", listener=checker, **via.kw
    ) as producer:
        consumer = await consume(b.address, "orders-rb", db, seen, via)
        try:
            async with async_sessionmaker(db.aengine)() as session:
                with pytest.raises(RuntimeError, match="payment declined"):
                    async with transaction(producer, session) as tx:
                        session.add(Order(id="o-2", amount=10))
                        await tx.send(Message("orders-rb", b"created", keys=["o-2"]))
                        raise RuntimeError("payment declined")
            assert tx.state is LocalTransactionState.ROLLBACK
            await until(lambda: none_pending(b.address))
            await anyio.sleep(1.0)  # several check rounds: nothing may surface
        finally:
            await consumer.stop()
    assert seen.messages == []
    assert db.order_ids() == []
    assert db.log_state(tx.transaction_id) is None  # the log row went with the rollback


class LosingEnds(TransactionProducer):
    """A producer whose COMMIT/ROLLBACK never reaches the broker (as if it crashed)."""

    async def end_transaction(
        self,
        result: SendResult,
        state: LocalTransactionState | str,
        *,
        from_check: bool = False,
        wait: bool = True,
    ) -> str:
        raise BrokerUnavailable("connection lost")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("outcome", ["commit", "rollback"])
async def test_lost_ending_is_resolved_by_the_check_back(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker], outcome: str, transport: str
) -> None:
    """Over gRPC the check-back arrives on the producer's Telemetry stream."""
    via = start_broker(embedded_broker, transport, **FAST)
    b = via.broker
    seen = Seen()
    checker = SqlTransactionChecker(db.aengine)
    async with LosingEnds(via.address, "orders-tx", listener=checker, **via.kw) as producer:
        consumer = await consume(b.address, "orders-lost", db, seen, via)
        try:
            async with AsyncSession(db.aengine) as session:
                with pytest.raises(ValueError) if outcome == "rollback" else _noop():
                    async with transaction(producer, session) as tx:
                        session.add(Order(id="o-3", amount=1))
                        await tx.send(Message("orders-lost", b"created", keys=["o-3"]))
                        if outcome == "rollback":
                            raise ValueError("no")

            async def resolved() -> bool:
                return not await pending(b.address)

            await until(resolved)
            if outcome == "commit":

                async def delivered() -> bool:
                    return len(seen.messages) == 1

                await until(delivered)
            else:
                await anyio.sleep(0.5)
        finally:
            await consumer.stop()
    if outcome == "commit":
        assert seen.committed_when_seen == [True]
        assert db.log_state(tx.transaction_id) == COMMITTED
    else:
        assert seen.messages == [] and db.order_ids() == []
        assert db.log_state(tx.transaction_id) == ROLLED_BACK  # written by the check


async def test_check_back_waits_for_a_slow_local_transaction(
    db: Db, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    """The broker checks while the local transaction is still open: UNKNOWN (never
    ROLLBACK), again and again; once the transaction commits, the message goes out."""
    b = embedded_broker(**FAST)
    seen = Seen()
    checker = SqlTransactionChecker(db.aengine, lock_timeout=0.2)
    answers: list[LocalTransactionState] = []
    real_check = checker.check

    async def recording_check(tid: str, group: str = "") -> LocalTransactionState:
        state = await real_check(tid, group)
        answers.append(state)
        return state

    checker.check = recording_check  # type: ignore[method-assign]
    async with LosingEnds(b.address, "orders-slow", listener=checker) as producer:
        consumer = await consume(b.address, "orders-slow", db, seen)
        try:
            async with AsyncSession(db.aengine) as session:
                async with transaction(producer, session) as tx:
                    session.add(Order(id="o-4", amount=1))
                    await session.flush()
                    await tx.send(Message("orders-slow", b"created", keys=["o-4"]))
                    with anyio.fail_after(15):
                        while len(answers) < 3:  # noqa: ASYNC110
                            await anyio.sleep(0.05)
                    assert seen.messages == []

            async def delivered() -> bool:
                return len(seen.messages) == 1

            await until(delivered)
        finally:
            await consumer.stop()
    assert LocalTransactionState.ROLLBACK not in answers
    assert answers[:3] == [LocalTransactionState.UNKNOWN] * 3
    assert answers[-1] is LocalTransactionState.COMMIT
    assert seen.committed_when_seen == [True]


def test_sync_session_with_the_sync_producer(
    sync_db: Db, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    b = embedded_broker(**FAST)
    received: list[MessageExt] = []
    lock = threading.Lock()

    def on_message(msg: MessageExt) -> None:
        with lock:
            received.append(msg)

    checker = SqlTransactionChecker(sync_db.engine)
    factory = sessionmaker(sync_db.engine)
    with txsync.AdminClient(b.address) as admin:
        admin.create_topic("orders-sync", 4)
    consumer = txsync.PushConsumer(
        b.address, "sync-readers", listener=on_message, consume_from="FIRST_OFFSET"
    )
    consumer.subscribe("orders-sync")
    with txsync.TransactionProducer(b.address, "orders-sync", listener=checker) as producer:
        with consumer:
            with Session(sync_db.engine) as session, transaction(producer, session) as tx:
                session.add(Order(id="s-1", amount=1))
                tx.send(Message("orders-sync", b"one", keys=["s-1"]))
            with pytest.raises(LookupError):
                with transaction(producer, factory) as tx2:
                    tx2.session.add(Order(id="s-2", amount=2))
                    tx2.send(Message("orders-sync", b"two", keys=["s-2"]))
                    raise LookupError("no such customer")
            wait_for(lambda: received)
            time.sleep(0.5)  # the rolled-back one never comes
    assert [m.body for m in received] == [b"one"]
    assert sync_db.order_ids() == ["s-1"]
    assert sync_db.log_state(tx.transaction_id) == COMMITTED
    assert sync_db.log_state(tx2.transaction_id) is None
    assert checker.check_sync(tx.transaction_id) is LocalTransactionState.COMMIT
    assert checker.check_sync(tx2.transaction_id) is LocalTransactionState.ROLLBACK
