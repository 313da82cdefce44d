"""txmq.sqla.transaction with fake producers on SQLite: what happens in which order."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import Engine, create_engine, event, func, insert, select
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, sessionmaker

from tests.sqla_support import (
    FakeAsyncProducer,
    FakeSyncProducer,
    Order,
    Recorder,
    create_all,
    order_lines,
    orders,
)
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import Message
from txmq.protocol.wire.errors import BrokerUnavailable
from txmq.sqla import COMMITTED, transaction, transaction_log

COMMIT = LocalTransactionState.COMMIT
ROLLBACK = LocalTransactionState.ROLLBACK
UNKNOWN = LocalTransactionState.UNKNOWN


def _watch(engine: Engine, rec: Recorder) -> None:
    """Record the log-row INSERT and every COMMIT / ROLLBACK of the database."""

    @event.listens_for(engine, "connect")
    def fk_on(dbapi_conn: Any, _: Any) -> None:
        dbapi_conn.execute("PRAGMA foreign_keys = ON")

    @event.listens_for(engine, "before_cursor_execute")
    def sql(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
        if statement.startswith("INSERT INTO txmq_transaction_log"):
            rec.events.append(("log-row",))

    @event.listens_for(engine, "commit")
    def commit(_c: Any) -> None:
        rec.events.append(("db-commit",))

    @event.listens_for(engine, "rollback")
    def rollback(_c: Any) -> None:
        rec.events.append(("db-rollback",))


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "app.db"
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        create_all(conn)
    engine.dispose()
    return path


@pytest.fixture
def engine(db_path: Path, rec: Recorder) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{db_path}")
    _watch(engine, rec)
    yield engine
    engine.dispose()


@pytest.fixture
async def aengine(db_path: Path, rec: Recorder) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(f"sqlite+aiosqlite:///{db_path}")
    _watch(engine.sync_engine, rec)
    yield engine
    await engine.dispose()


def rows(engine: Engine | AsyncEngine) -> tuple[list[Any], list[Any]]:
    """(orders, log rows) as committed, read on a fresh sync connection."""
    url = engine.url.set(drivername="sqlite")
    reader = create_engine(url)
    with reader.connect() as conn:
        got = (
            list(conn.execute(select(orders.c.id, orders.c.amount))),
            list(conn.execute(select(transaction_log.c.transaction_id, transaction_log.c.state))),
        )
    reader.dispose()
    return got


def kinds(rec: Recorder) -> list[str]:
    return [e[0] for e in rec.events]


# -- AsyncSession ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_commit_order(aengine: AsyncEngine, rec: Recorder) -> None:
    producer = FakeAsyncProducer(rec)
    async with AsyncSession(aengine) as session:
        async with transaction(producer, session) as tx:
            assert kinds(rec) == ["log-row"]  # inserted on enter, before any half message
            session.add(Order(id="o-1", amount=5))
            r1 = await tx.send(Message("orders", b"created", keys=["o-1"]), sharding_key="o-1")
            r2 = await tx.send(Message("billing", b"charge"))
            assert rows(aengine) == ([], [])  # nothing visible before the commit
    assert kinds(rec) == ["log-row", "half", "half", "db-commit", "end", "end"]
    assert rec.halves()[0][2:] == (tx.transaction_id, "orders", "o-1")
    assert rec.ends() == [(r1.msg_id, COMMIT), (r2.msg_id, COMMIT)]
    assert tx.state is COMMIT and tx.results == [r1, r2]
    assert rows(aengine) == ([("o-1", 5)], [(tx.transaction_id, COMMITTED)])
    assert len(tx.transaction_id) == 32


@pytest.mark.anyio
async def test_async_exception_rolls_back_everything(aengine: AsyncEngine, rec: Recorder) -> None:
    producer = FakeAsyncProducer(rec)
    async with AsyncSession(aengine) as session:
        with pytest.raises(ValueError, match="out of stock"):
            async with transaction(producer, session) as tx:
                await session.execute(insert(orders).values(id="o-2", amount=1))
                r1 = await tx.send(Message("orders", b"a"))
                r2 = await tx.send(Message("orders", b"b"))
                raise ValueError("out of stock")
    assert "db-commit" not in kinds(rec)
    assert rec.ends() == [(r1.msg_id, ROLLBACK), (r2.msg_id, ROLLBACK)]
    assert tx.state is ROLLBACK
    assert rows(aengine) == ([], [])


@pytest.mark.anyio
async def test_async_commit_failure_rolls_back(aengine: AsyncEngine, rec: Recorder) -> None:
    """A deferred foreign key fails at COMMIT: the database refused, so ROLLBACK."""
    producer = FakeAsyncProducer(rec)
    async with AsyncSession(aengine) as session:
        with pytest.raises(IntegrityError):
            async with transaction(producer, session) as tx:
                await session.execute(insert(orders).values(id="o-3", amount=1))
                await session.execute(insert(order_lines).values(id=1, order_id="missing"))
                r = await tx.send(Message("orders", b"x"))
    assert rec.ends() == [(r.msg_id, ROLLBACK)]
    assert tx.state is ROLLBACK
    assert rows(aengine) == ([], [])


@pytest.mark.anyio
async def test_async_flush_failure_rolls_back(aengine: AsyncEngine, rec: Recorder) -> None:
    async with AsyncSession(aengine) as session:
        await session.execute(insert(orders).values(id="dup", amount=1))
        await session.commit()
    producer = FakeAsyncProducer(rec)
    async with async_sessionmaker(aengine)() as session:
        with pytest.raises(IntegrityError):
            async with transaction(producer, session) as tx:
                session.add(Order(id="dup", amount=2))  # flushed by the commit: fails
                await tx.send(Message("orders", b"x"))
    assert rec.ends() == [(tx.results[0].msg_id, ROLLBACK)]
    assert rows(aengine) == ([("dup", 1)], [])


@pytest.mark.anyio
async def test_async_commit_in_doubt_is_left_to_check_back(
    aengine: AsyncEngine, rec: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection breaks while COMMIT is on its way: nobody knows whether it
    committed, so nothing is ended — the check-back decides from the log."""
    producer = FakeAsyncProducer(rec)
    async with AsyncSession(aengine) as session:

        async def broken_commit() -> None:
            raise DBAPIError(
                "COMMIT", None, OSError("connection reset"), connection_invalidated=True
            )

        with pytest.raises(DBAPIError), caplog.at_level(logging.WARNING, "txmq.sqla"):
            async with transaction(producer, session) as tx:
                await tx.send(Message("orders", b"x"))
                session.commit = broken_commit  # type: ignore[method-assign]
    assert rec.ends() == []
    assert tx.state is UNKNOWN
    assert "check-back" in caplog.text and tx.transaction_id in caplog.text


@pytest.mark.anyio
async def test_async_end_failure_after_commit_is_logged_not_raised(
    aengine: AsyncEngine, rec: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    producer = FakeAsyncProducer(rec, end_error=BrokerUnavailable("broker down"))
    async with AsyncSession(aengine) as session:
        with caplog.at_level(logging.WARNING, "txmq.sqla"):
            async with transaction(producer, session) as tx:
                await session.execute(insert(orders).values(id="o-4", amount=1))
                await tx.send(Message("orders", b"a"))
                await tx.send(Message("orders", b"b"))
    assert [s for _, s in rec.ends()] == [COMMIT, COMMIT]  # every half was tried
    assert tx.state is COMMIT
    assert rows(aengine) == ([("o-4", 1)], [(tx.transaction_id, COMMITTED)])
    assert caplog.text.count("could not end transaction") == 2


@pytest.mark.anyio
async def test_async_cancelled_block_rolls_back(aengine: AsyncEngine, rec: Recorder) -> None:
    producer = FakeAsyncProducer(rec)
    async with AsyncSession(aengine) as session:
        with anyio.move_on_after(0.2):
            async with transaction(producer, session) as tx:
                await session.execute(insert(orders).values(id="o-5", amount=1))
                await tx.send(Message("orders", b"a"))
                await anyio.sleep(10)
    assert rec.ends() == [(tx.results[0].msg_id, ROLLBACK)]
    assert rows(aengine) == ([], [])


@pytest.mark.anyio
async def test_async_sessionmaker_makes_and_closes_the_session(
    aengine: AsyncEngine, rec: Recorder
) -> None:
    factory = async_sessionmaker(aengine)
    async with transaction(FakeAsyncProducer(rec), factory, group="g2") as tx:
        await tx.session.execute(insert(orders).values(id="o-6", amount=6))
        await tx.send(Message("orders", b"a"))
    assert not tx.session.in_transaction()
    assert rows(aengine) == ([("o-6", 6)], [(tx.transaction_id, COMMITTED)])
    async with aengine.connect() as conn:
        group = (await conn.execute(select(transaction_log.c.producer_group))).scalar()
    assert group == "g2"


@pytest.mark.anyio
async def test_commit_inside_the_block_is_refused(aengine: AsyncEngine, rec: Recorder) -> None:
    async with AsyncSession(aengine) as session:
        with pytest.raises(RuntimeError, match=r"inside txmq\.sqla\.transaction"):
            async with transaction(FakeAsyncProducer(rec), session) as tx:
                await tx.send(Message("orders", b"a"))
                await session.commit()
    assert rec.ends() == []  # the log row says COMMITTED: left to the check-back
    assert tx.state is UNKNOWN
    assert rows(aengine) == ([], [(tx.transaction_id, COMMITTED)])


@pytest.mark.anyio
async def test_send_outside_the_block_and_wrong_producers(
    aengine: AsyncEngine, rec: Recorder
) -> None:
    async with AsyncSession(aengine) as session:
        async with transaction(FakeAsyncProducer(rec), session) as tx:
            pass
        with pytest.raises(RuntimeError, match="not open"):
            await tx.send(Message("orders", b"late"))
        with pytest.raises(TypeError, match="async producer"):
            transaction(FakeSyncProducer(rec), session)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="not a transaction producer"):
            transaction(object(), session)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="Session"):
            transaction(FakeAsyncProducer(rec), "not a session")  # type: ignore[call-overload]
        with pytest.raises(ValueError, match="64"):
            transaction(FakeAsyncProducer(rec), session, transaction_id="x" * 65)
    assert rows(aengine)[1] == [(tx.transaction_id, COMMITTED)]  # an empty transaction commits


@pytest.mark.anyio
async def test_missing_table_says_what_to_run(tmp_path: Path, rec: Recorder) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}")
    try:
        async with AsyncSession(engine) as session:
            with pytest.raises(OperationalError) as info:
                async with transaction(FakeAsyncProducer(rec), session):
                    pass
        assert "txmq db upgrade" in "".join(info.value.__notes__)
        assert rec.events == []
    finally:
        await engine.dispose()


# -- sync Session ------------------------------------------------------------------------------


def test_sync_commit_order(engine: Engine, rec: Recorder) -> None:
    producer = FakeSyncProducer(rec)
    with Session(engine) as session, transaction(producer, session) as tx:
        assert kinds(rec) == ["log-row"]
        session.execute(insert(orders).values(id="s-1", amount=1))
        r1 = tx.send(Message("orders", b"a"), sharding_key="s-1")
        r2 = tx.send(Message("orders", b"b"))
    assert kinds(rec) == ["log-row", "half", "half", "db-commit", "end", "end"]
    assert rec.ends() == [(r1.msg_id, COMMIT), (r2.msg_id, COMMIT)]
    assert rows(engine) == ([("s-1", 1)], [(tx.transaction_id, COMMITTED)])
    with engine.connect() as conn:
        group = conn.execute(select(transaction_log.c.producer_group)).scalar()
    assert group == FakeAsyncProducer.group  # found through the facade's .aio


def test_sync_exception_rolls_back_everything(engine: Engine, rec: Recorder) -> None:
    with Session(engine) as session, pytest.raises(KeyError):
        with transaction(FakeSyncProducer(rec), session) as tx:
            session.execute(insert(orders).values(id="s-2", amount=1))
            r = tx.send(Message("orders", b"a"))
            raise KeyError("boom")
    assert "db-commit" not in kinds(rec)
    assert rec.ends() == [(r.msg_id, ROLLBACK)]
    assert rows(engine) == ([], [])


def test_sync_commit_failure_rolls_back(engine: Engine, rec: Recorder) -> None:
    factory = sessionmaker(engine)
    with pytest.raises(IntegrityError):
        with transaction(FakeSyncProducer(rec), factory) as tx:
            tx.session.execute(insert(order_lines).values(id=1, order_id="missing"))
            r = tx.send(Message("orders", b"a"))
    assert rec.ends() == [(r.msg_id, ROLLBACK)]
    assert tx.state is ROLLBACK
    assert rows(engine) == ([], [])


def test_sync_end_failure_after_commit_is_logged(
    engine: Engine, rec: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    producer = FakeSyncProducer(rec, end_error=BrokerUnavailable("down"))
    with Session(engine) as session, caplog.at_level(logging.WARNING, "txmq.sqla"):
        with transaction(producer, session) as tx:
            tx.send(Message("orders", b"a"))
    assert tx.state is COMMIT
    assert "check-back will resolve it" in caplog.text
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(transaction_log)).scalar() == 1
