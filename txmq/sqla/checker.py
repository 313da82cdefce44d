"""The exact check-back: what became of a local transaction, decided from the log table.

The broker asks a producer of the group about a half message whose COMMIT/ROLLBACK never
arrived. :class:`SqlTransactionChecker` answers from ``txmq_transaction_log``:

- it tries to INSERT ``(transaction_id, group, 'ROLLED_BACK')`` in a new, short database
  transaction. A local transaction still in flight holds that primary key (it inserted its
  ``COMMITTED`` row first), so the insert waits for it — at most ``lock_timeout`` seconds
  (PostgreSQL: ``SET LOCAL lock_timeout``; SQLite: the writer lock and its busy timeout),
  after which the answer is UNKNOWN and the broker asks again later;
- if the insert went in, it is committed and the answer is ROLLBACK: the id is now taken,
  so a late local transaction with that id fails on the duplicate key and cannot commit;
- if the id was already there, the committed row decides: COMMITTED → COMMIT,
  ROLLED_BACK → ROLLBACK.

It never answers ROLLBACK while the local transaction could still commit, and any error
(database down, timeout) is UNKNOWN, never a guess.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from sqlalchemy import Connection, Engine, delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.orm import sessionmaker

from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import Message, MessageExt, Prop
from txmq.sqla.tables import COMMITTED, ROLLED_BACK, transaction_log

if TYPE_CHECKING:
    from txmq.client.transaction import TransactionListener

__all__ = ["SqlTransactionChecker", "begin_immediate"]

log = logging.getLogger("txmq.sqla")

SUPPORTED_DIALECTS = ("postgresql", "sqlite")
DEFAULT_RETENTION = timedelta(days=7)


class SqlTransactionChecker:
    """Answers the broker's check-back from ``txmq_transaction_log``; exact.

    ``bind`` is a sync :class:`Engine`, an :class:`AsyncEngine`, or a ``sessionmaker`` /
    ``async_sessionmaker`` bound to one — the database the local transactions run in.
    Use it as a transaction producer's listener::

        checker = SqlTransactionChecker(engine)
        producer = TransactionProducer(address, group="orders", listener=checker)

    :meth:`check_local_transaction` is a coroutine (a sync engine's work runs in a worker
    thread, so the producer's event loop never blocks on a lock wait); :meth:`check_sync`
    is the blocking form for sync engines. ``lock_timeout`` (seconds) bounds how long a
    check waits for a local transaction still in flight before answering UNKNOWN.
    SQLite databases must be files (an in-memory database is private to one connection).
    """

    def __init__(
        self,
        bind: Engine | AsyncEngine | sessionmaker[Any] | async_sessionmaker[Any],
        *,
        lock_timeout: float = 2.0,
        group: str | None = None,
    ) -> None:
        if isinstance(bind, sessionmaker | async_sessionmaker):
            bound = bind.kw.get("bind")
            if not isinstance(bound, Engine | AsyncEngine):
                raise TypeError("the session factory must be bound to an engine (bind=engine)")
            bind = bound
        if not isinstance(bind, Engine | AsyncEngine):
            raise TypeError(f"expected an Engine, AsyncEngine or session factory; got {bind!r}")
        if bind.dialect.name not in SUPPORTED_DIALECTS:
            raise ValueError(
                f"SqlTransactionChecker supports {' and '.join(SUPPORTED_DIALECTS)}; "
                f"not {bind.dialect.name}"
            )
        if not lock_timeout > 0:
            raise ValueError("lock_timeout must be positive")
        self.engine = bind
        self.lock_timeout = lock_timeout
        self.group = group

    # -- the listener --------------------------------------------------------------------

    def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
        """Not supported: run local transactions with :func:`txmq.sqla.transaction`, which
        writes the log row this checker reads (``send_message_in_transaction`` cannot)."""
        raise TypeError(
            "SqlTransactionChecker only answers check-backs: run the local transaction with "
            "txmq.sqla.transaction(producer, session) instead of send_message_in_transaction"
        )

    async def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        """The producer's listener callback: the state of ``msg``'s local transaction."""
        transaction_id = msg.get_property(Prop.TRANSACTION_ID)
        if not transaction_id:
            log.warning("check-back for message %s without a transaction id", msg.msg_id)
            return LocalTransactionState.UNKNOWN
        group = self.group or msg.get_property(Prop.PRODUCER_GROUP) or ""
        return await self.check(transaction_id, group)

    async def check(self, transaction_id: str, group: str = "") -> LocalTransactionState:
        """COMMIT, ROLLBACK (and from now on the id can never commit), or UNKNOWN."""
        if isinstance(self.engine, AsyncEngine):
            try:
                async with self.engine.connect() as conn:
                    return await conn.run_sync(self._check_on, transaction_id, group)
            except SQLAlchemyError as exc:
                return self._unknown(transaction_id, exc)
        return await anyio.to_thread.run_sync(self.check_sync, transaction_id, group)

    def check_sync(self, transaction_id: str, group: str = "") -> LocalTransactionState:
        """:meth:`check` for a sync engine, blocking."""
        engine = self._sync_engine("check_sync")
        try:
            with engine.connect() as conn:
                return self._check_on(conn, transaction_id, group)
        except SQLAlchemyError as exc:
            return self._unknown(transaction_id, exc)

    def _check_on(self, conn: Connection, transaction_id: str, group: str) -> LocalTransactionState:
        row = {"transaction_id": transaction_id, "producer_group": group, "state": ROLLED_BACK}
        ms = max(1, round(self.lock_timeout * 1000))
        if conn.dialect.name == "postgresql":
            conn.execution_options(isolation_level="READ COMMITTED")
            with conn.begin():
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{ms}ms'")
                stmt = (
                    pg_insert(transaction_log)
                    .values(row)
                    .on_conflict_do_nothing(index_elements=[transaction_log.c.transaction_id])
                )
                inserted = conn.execute(stmt.returning(transaction_log.c.transaction_id))
                if inserted.first() is None:
                    return self._decide(conn, transaction_id)
            return LocalTransactionState.ROLLBACK  # committed: the id can no longer commit
        # SQLite: BEGIN IMMEDIATE takes the writer lock, waiting busy_timeout for a local
        # transaction that holds it (it inserted its log row when it began).
        previous = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {ms}")
        try:
            begin_immediate(conn)
            try:
                lite = (
                    sqlite_insert(transaction_log)
                    .values(row)
                    .on_conflict_do_nothing(index_elements=[transaction_log.c.transaction_id])
                )
                if conn.execute(lite).rowcount == 1:
                    conn.commit()
                    return LocalTransactionState.ROLLBACK
                return self._decide(conn, transaction_id)
            finally:
                conn.rollback()  # after a commit, a no-op
        finally:
            conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(previous or 0)}")
            conn.commit()

    @staticmethod
    def _decide(conn: Connection, transaction_id: str) -> LocalTransactionState:
        state = conn.execute(
            select(transaction_log.c.state).where(
                transaction_log.c.transaction_id == transaction_id
            )
        ).scalar()
        if state == COMMITTED:
            return LocalTransactionState.COMMIT
        if state == ROLLED_BACK:
            return LocalTransactionState.ROLLBACK
        log.warning("transaction %s: unexpected log state %r", transaction_id, state)
        return LocalTransactionState.UNKNOWN

    @staticmethod
    def _unknown(transaction_id: str, exc: SQLAlchemyError) -> LocalTransactionState:
        if _is_lock_wait(exc):
            log.info("transaction %s is still in flight; answering UNKNOWN", transaction_id)
        else:
            log.warning(
                "check of transaction %s failed (%s); answering UNKNOWN", transaction_id, exc
            )
        return LocalTransactionState.UNKNOWN

    # -- retention -----------------------------------------------------------------------

    async def cleanup(
        self, older_than: timedelta = DEFAULT_RETENTION, *, batch_size: int = 10_000
    ) -> int:
        """Delete log rows older than ``older_than``; returns how many.

        Keep rows longer than the broker can still check a half message (by default 15
        checks 30 s apart, plus any time the broker or producers were down): a check for a
        committed transaction whose row is gone would answer ROLLBACK.
        """
        if isinstance(self.engine, AsyncEngine):
            async with self.engine.connect() as conn:
                return await conn.run_sync(cleanup_on, older_than, batch_size)
        return await anyio.to_thread.run_sync(
            lambda: self.cleanup_sync(older_than, batch_size=batch_size)
        )

    def cleanup_sync(
        self, older_than: timedelta = DEFAULT_RETENTION, *, batch_size: int = 10_000
    ) -> int:
        """:meth:`cleanup` for a sync engine, blocking."""
        with self._sync_engine("cleanup_sync").connect() as conn:
            return cleanup_on(conn, older_than, batch_size)

    def _sync_engine(self, what: str) -> Engine:
        if isinstance(self.engine, AsyncEngine):
            raise TypeError(
                f"{what}() needs a sync Engine; with an AsyncEngine await the async form"
            )
        return self.engine


def cleanup_on(conn: Connection, older_than: timedelta, batch_size: int) -> int:
    if older_than <= timedelta(0):
        raise ValueError("older_than must be positive")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    cutoff = datetime.now(UTC) - older_than
    if conn.dialect.name == "sqlite":
        cutoff = cutoff.replace(tzinfo=None)  # SQLite stores CURRENT_TIMESTAMP as UTC text
    t = transaction_log
    total = 0
    while True:
        ids = select(t.c.transaction_id).where(t.c.created_at < cutoff).limit(batch_size)
        with conn.begin():
            deleted = conn.execute(delete(t).where(t.c.transaction_id.in_(ids))).rowcount
        total += deleted
        if deleted < batch_size:
            return total


def begin_immediate(conn: Connection) -> None:
    """SQLite: begin a transaction that holds the writer lock from its first statement
    (``BEGIN IMMEDIATE``), waiting up to the busy timeout for it."""
    try:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    except OperationalError as exc:
        if "within a transaction" not in str(exc.orig):
            raise
        # The engine began a (deferred) transaction itself, as SQLAlchemy's pysqlite
        # "begin" recipe does; the first write that follows takes the writer lock
        # instead, waiting the same busy timeout.


def _is_lock_wait(exc: BaseException) -> bool:
    if not isinstance(exc, DBAPIError):
        return False
    if getattr(exc.orig, "sqlstate", None) == "55P03":  # PostgreSQL lock_not_available
        return True
    return "database is locked" in str(exc.orig)


if TYPE_CHECKING:

    def _is_a_listener(checker: SqlTransactionChecker) -> TransactionListener:
        return checker  # mypy proves the checker fits TransactionProducer.listener
