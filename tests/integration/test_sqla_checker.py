"""SqlTransactionChecker is exact, on real PostgreSQL and SQLite, sync and async engines:
it never answers ROLLBACK while the local transaction could still commit, and after it
answered ROLLBACK the late transaction can no longer commit."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import Engine, create_engine, event, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from tests.sqla_support import create_all, pg_schema
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import MessageExt, Prop
from txmq.sqla import COMMITTED, ROLLED_BACK, SqlTransactionChecker, transaction_log

pytestmark = pytest.mark.anyio

COMMIT = LocalTransactionState.COMMIT
ROLLBACK = LocalTransactionState.ROLLBACK
UNKNOWN = LocalTransactionState.UNKNOWN


@dataclass
class Db:
    backend: str
    mode: str
    url: str  # sync driver
    aurl: str  # async driver
    engine: Engine  # for the "application" side of each test
    checkers: list[SqlTransactionChecker]

    def checker(self, lock_timeout: float = 0.5, **kw: Any) -> SqlTransactionChecker:
        if self.mode == "sync":
            c = SqlTransactionChecker(create_engine(self.url), lock_timeout=lock_timeout, **kw)
        else:
            c = SqlTransactionChecker(
                create_async_engine(self.aurl), lock_timeout=lock_timeout, **kw
            )
        self.checkers.append(c)
        return c

    def state_of(self, tid: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(
                select(transaction_log.c.state).where(transaction_log.c.transaction_id == tid)
            ).scalar()


@pytest.fixture(params=["sqlite-sync", "sqlite-async", "postgresql-sync", "postgresql-async"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Db]:
    backend, mode = request.param.split("-")
    with _urls(backend, tmp_path) as (url, aurl):
        engine = create_engine(url)
        with engine.begin() as conn:
            create_all(conn)
        d = Db(backend, mode, url, aurl, engine, [])
        try:
            yield d
        finally:
            for c in d.checkers:
                if isinstance(c.engine, Engine):
                    c.engine.dispose()
                else:
                    await c.engine.dispose()
            engine.dispose()


@contextmanager
def _urls(backend: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(sync URL, async URL) of an empty database."""
    if backend == "sqlite":
        path = tmp_path / "app.db"
        yield f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}"
        return
    with pg_schema() as url:
        yield url, url  # psycopg 3 is both: create_async_engine picks its async side


def new_id() -> str:
    return uuid.uuid4().hex


def log_row(tid: str, state: str = COMMITTED) -> Any:
    return insert(transaction_log).values(transaction_id=tid, producer_group="g", state=state)


async def check(db: Db, checker: SqlTransactionChecker, tid: str) -> LocalTransactionState:
    """Both entry points must agree; the sync one is tried first for sync engines."""
    if db.mode == "sync":
        return checker.check_sync(tid, "g")
    return await checker.check(tid, "g")


@pytest.fixture
def holder(db: Db) -> Iterator[Any]:
    """A connection of "the application" holding a local transaction open."""
    conn = db.engine.connect()
    yield conn
    conn.close()


async def test_committed_transaction_is_commit(db: Db) -> None:
    tid = new_id()
    with db.engine.begin() as conn:
        conn.execute(log_row(tid))
    checker = db.checker()
    assert await check(db, checker, tid) is COMMIT
    assert await checker.check(tid) is COMMIT  # the coroutine form, for any engine
    msg = MessageExt("orders", b"", 0, 0, 0, 0, 0, 0)
    msg.all_properties = {Prop.TRANSACTION_ID: tid, Prop.PRODUCER_GROUP: "g"}
    assert await checker.check_local_transaction(msg) is COMMIT
    assert db.state_of(tid) == COMMITTED


async def test_unknown_id_is_rollback_and_can_never_commit(db: Db) -> None:
    tid = new_id()
    checker = db.checker()
    assert await check(db, checker, tid) is ROLLBACK
    assert db.state_of(tid) == ROLLED_BACK
    # the late local transaction now fails on the duplicate key
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        conn.execute(log_row(tid))
    assert await check(db, checker, tid) is ROLLBACK  # asked again: same answer
    assert db.state_of(tid) == ROLLED_BACK


async def test_in_flight_transaction_is_unknown_then_commit(db: Db, holder: Any) -> None:
    tid = new_id()
    holder.begin()
    holder.execute(log_row(tid))  # uncommitted: holds the key (SQLite: the writer lock)
    checker = db.checker(lock_timeout=0.5)
    started = time.monotonic()
    assert await check(db, checker, tid) is UNKNOWN  # never ROLLBACK
    assert time.monotonic() - started < 3.0
    holder.commit()
    assert await check(db, checker, tid) is COMMIT
    assert db.state_of(tid) == COMMITTED


async def test_in_flight_transaction_that_rolls_back(db: Db, holder: Any) -> None:
    tid = new_id()
    holder.begin()
    holder.execute(log_row(tid))
    checker = db.checker(lock_timeout=0.3)
    assert await check(db, checker, tid) is UNKNOWN
    holder.rollback()
    assert await check(db, checker, tid) is ROLLBACK
    with pytest.raises(IntegrityError), db.engine.begin() as conn:
        conn.execute(log_row(tid))


async def test_check_waits_for_the_in_flight_transaction(db: Db, holder: Any) -> None:
    """A transaction that commits while the check waits on its key makes it COMMIT."""
    tid = new_id()
    holder.begin()
    holder.execute(log_row(tid))
    timer = threading.Timer(0.4, holder.commit)
    timer.start()
    try:
        started = time.monotonic()
        assert await check(db, db.checker(lock_timeout=10), tid) is COMMIT
        assert 0.3 < time.monotonic() - started < 8
    finally:
        timer.join()


async def test_database_down_is_unknown(db: Db) -> None:
    if db.backend == "sqlite":
        url, aurl = "sqlite:////nonexistent/dir/x.db", "sqlite+aiosqlite:////nonexistent/dir/x.db"
    else:
        url = aurl = "postgresql+psycopg://postgres@127.0.0.1:1/test"
    down = Db(db.backend, db.mode, url, aurl, db.engine, db.checkers)
    assert await check(down, down.checker(), new_id()) is UNKNOWN
    # aiosqlite stops its worker thread after a failed connect without waiting for it;
    # let it finish while this test's event loop still runs.
    for _ in range(200):
        if not any("_connection_worker_thread" in t.name for t in threading.enumerate()):
            break
        await anyio.sleep(0.01)


async def test_cleanup_deletes_old_rows_only(db: Db) -> None:
    old, new = new_id(), new_id()
    with db.engine.begin() as conn:
        conn.execute(log_row(old).values(created_at=datetime(2000, 1, 1, tzinfo=UTC)))
        conn.execute(log_row(new))
    checker = db.checker()
    if db.mode == "sync":
        assert checker.cleanup_sync(timedelta(days=1), batch_size=1) == 1
    else:
        assert await checker.cleanup(timedelta(days=1)) == 1
    assert db.state_of(old) is None and db.state_of(new) == COMMITTED


def test_checker_arguments(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    assert SqlTransactionChecker(sessionmaker(engine)).engine is engine
    aengine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    assert SqlTransactionChecker(async_sessionmaker(aengine)).engine is aengine
    with pytest.raises(TypeError, match="bound"):
        SqlTransactionChecker(sessionmaker())
    with pytest.raises(ValueError, match="lock_timeout"):
        SqlTransactionChecker(engine, lock_timeout=0)
    with pytest.raises(TypeError, match="sync Engine"):
        SqlTransactionChecker(aengine).check_sync("x")
    with pytest.raises(TypeError, match="transaction"):
        SqlTransactionChecker(engine).execute_local_transaction(None, None)  # type: ignore[arg-type]
    engine.dispose()


def test_sqlite_engine_with_the_begin_recipe(tmp_path: Path) -> None:
    """SQLAlchemy's pysqlite recipe (driver autocommit + BEGIN on the "begin" event):
    the checker still waits for the writer and stays exact."""
    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")

    @event.listens_for(engine, "connect")
    def no_driver_transactions(dbapi_conn: Any, _: Any) -> None:
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN")

    with engine.begin() as conn:
        create_all(conn)
    checker = SqlTransactionChecker(engine, lock_timeout=0.3)
    try:
        with engine.connect() as holder:
            holder.execute(log_row("in-flight"))  # the recipe's BEGIN, then the insert
            assert checker.check_sync("in-flight") is UNKNOWN
            holder.commit()
        assert checker.check_sync("in-flight") is COMMIT
        assert checker.check_sync("never") is ROLLBACK
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(log_row("never"))
    finally:
        engine.dispose()
