"""Idempotent consumers: apply each message once, with the dedupe key in your database.

::

    @txmq.idempotent(async_sessionmaker(engine))
    async def on_order(msg: MessageExt, session: AsyncSession) -> None:
        session.add(Invoice(order_id=msg.keys[0], ...))   # committed with the key, or not

    consumer = PushConsumer(address, "billing", listener=on_order)

**Transaction mode** (default): the message's dedupe key is inserted into
``txmq_consumed_keys`` in the same database transaction as the handler's writes (through
the session it is given). A duplicate finds the key and is skipped and acknowledged; a
handler failure rolls back both, and the message is retried. Two consumers racing on the
same message: the second one's insert waits for the first transaction, then finds the key.
A handler that dead-letters the message (raises ``txmq.DeadLetter``, or returns
``DEAD_LETTER``) rolls back both too: nothing is applied and the key stays free, so that the
message applies once it is re-sent from the dead-letter queue.

**Mark mode** (``mode="mark"``, handler ``handler(msg)``) for effects outside the
database: a ``consuming`` mark with an expiry is committed first, then the handler runs,
then the mark becomes ``done``. A valid mark of someone else means "later"
(``RECONSUME_LATER``); an expired one (its consumer crashed) is taken over; ``done`` is
skipped. A crash inside the handler can repeat the handler's outside effects once the
mark expires — at least once, never after it finished.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

from sqlalchemy import Connection, Engine, bindparam, delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import sessionmaker

from txmq.consumer.push import ConsumeResult
from txmq.observability import hooks as observe
from txmq.protocol.message import MessageExt
from txmq.sqla.db import on_psycopg
from txmq.sqla.tables import CONSUMING, DONE, consumed_keys, insert_if_absent, inserted

__all__ = [
    "DEFAULT_EXPIRY",
    "cleanup_consumed_keys",
    "default_key",
    "idempotent",
]

log = logging.getLogger("txmq.idempotent")

DEFAULT_EXPIRY = timedelta(minutes=5)
MAX_KEY_LENGTH = 255

F = TypeVar("F", bound=Callable[..., Any])
Mode = Literal["transaction", "mark"]
Bind = Engine | AsyncEngine | sessionmaker[Any] | async_sessionmaker[Any]


def default_key(msg: MessageExt) -> str:
    """The first message key, else the message id. Messages from the outbox keep their
    id on every re-send; give each *event* its own first key (``order-42-paid``, not
    ``42``), or pass ``key=lambda m: m.msg_id``."""
    keys = msg.keys
    return keys[0] if keys else msg.msg_id


def idempotent(
    bind: Bind,
    *,
    key: Callable[[MessageExt], str] = default_key,
    group: str | None = None,
    mode: Mode = "transaction",
    expiry: timedelta | float = DEFAULT_EXPIRY,
    on_duplicate: Callable[[MessageExt, str], None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[[MessageExt], Any]]:
    """Make ``handler`` a push-consumer listener that applies each message once.

    ``bind``: a ``sessionmaker`` or ``Engine`` for a sync handler, an
    ``async_sessionmaker`` or ``AsyncEngine`` for an ``async def`` handler (PostgreSQL or
    SQLite, with ``txmq db upgrade`` run). ``key(msg)``: the dedupe key (default: the first
    message key, else the message id; longer than 255 characters → its SHA-256).
    ``group``: the dedupe scope (default: the handler's module and name) — use one per
    consumer group, shared by its members. ``mode``: ``"transaction"`` — the handler is
    ``handler(msg, session)`` and its writes through ``session`` commit together with the
    key (don't commit it yourself) — or ``"mark"`` — ``handler(msg)`` with effects
    outside the database, guarded by a ``consuming`` mark that expires after ``expiry``
    (make it longer than the handler can take). ``on_duplicate(msg, key)`` is called
    (in the listener's thread or task) for each message skipped as a duplicate: a metric.

    The handler returns None/SUCCESS, or ``RECONSUME_LATER`` (or False) to roll back and
    retry, or ``DEAD_LETTER`` to roll back and dead-letter; an exception rolls back too
    (and is raised to the consumer: retry; ``txmq.DeadLetter``: to the dead-letter queue).
    A rolled-back message's key is not recorded (mark mode: its mark is released).
    """
    if mode not in ("transaction", "mark"):
        raise ValueError(f"mode must be 'transaction' or 'mark', not {mode!r}")
    ttl = expiry if isinstance(expiry, timedelta) else timedelta(seconds=float(expiry))
    if ttl <= timedelta(0):
        raise ValueError("expiry must be positive")
    factory, is_async = _factory(bind)

    def decorate(handler: Callable[..., Any]) -> Callable[[MessageExt], Any]:
        if inspect.iscoroutinefunction(handler) != is_async:
            raise TypeError(
                f"{handler.__qualname__} is {'an async' if not is_async else 'a sync'} "
                f"handler but the database binding is "
                f"{'async' if is_async else 'sync'}: pair async def with an AsyncEngine / "
                "async_sessionmaker, def with an Engine / sessionmaker"
            )
        scope = (group or f"{handler.__module__}.{handler.__qualname__}")[:MAX_KEY_LENGTH]
        guard = _Guard(scope, key, ttl, on_duplicate)
        if mode == "transaction":
            made = guard.async_tx(handler, factory) if is_async else guard.tx(handler, factory)
        else:
            made = guard.async_mark(handler, factory) if is_async else guard.mark(handler, factory)
        made.__name__ = getattr(handler, "__name__", "listener")
        made.__qualname__ = getattr(handler, "__qualname__", made.__name__)
        made.__doc__ = handler.__doc__
        made.__wrapped__ = handler  # type: ignore[attr-defined]
        return made

    return decorate


def _factory(bind: Bind) -> tuple[Any, bool]:
    if isinstance(bind, async_sessionmaker):
        return bind, True
    if isinstance(bind, sessionmaker):
        return bind, False
    if isinstance(bind, AsyncEngine):
        return async_sessionmaker(bind, expire_on_commit=False), True
    if isinstance(bind, Engine):
        return sessionmaker(bind, expire_on_commit=False), False
    raise TypeError(f"expected an Engine, AsyncEngine or session factory; got {bind!r}")


def _engine_of(factory: Any) -> Any:
    engine = factory.kw.get("bind")
    if not isinstance(engine, Engine | AsyncEngine):
        raise TypeError("mark mode needs a session factory bound to an engine (bind=engine)")
    return engine


def _failed(result: Any) -> ConsumeResult | None:
    """What a handler's result asks the consumer for when it is not a success: later, or
    the dead-letter queue (roll back either way); None: it is a success."""
    if result is False or result is ConsumeResult.RECONSUME_LATER:
        return ConsumeResult.RECONSUME_LATER
    if result is ConsumeResult.DEAD_LETTER:
        return ConsumeResult.DEAD_LETTER
    return None


_INSERTS: dict[str, Any] = {}


def _insert(dialect: str) -> Any:
    """INSERT a key unless it is there (parameters g, k, s, e, c: group, key, state,
    expires_at, created_at), built once per dialect."""
    stmt = _INSERTS.get(dialect)
    if stmt is None:
        stmt = _INSERTS[dialect] = insert_if_absent(consumed_keys, dialect).values(
            consumer_group=bindparam("g"),
            key=bindparam("k"),
            state=bindparam("s"),
            expires_at=bindparam("e"),
            created_at=bindparam("c"),
        )
    return stmt


_DRIVER_SQL: dict[Any, str] = {}


def _driver_sql(conn: Connection) -> str | None:
    """The dedupe INSERT as SQL for ``conn``'s psycopg connection itself, built once per
    dialect; None for any other driver, or a connection that maps schemas
    (``schema_translate_map``): those go through SQLAlchemy.

    Run on the driver's own connection (in the transaction SQLAlchemy began on it), the
    statement costs a consumer about half the CPU it costs through SQLAlchemy's
    execution (async: its greenlet hop and result objects) — the one statement that
    ``txmq.idempotent`` adds to a handler's transaction."""
    if not on_psycopg(conn):
        return None
    dialect = conn.dialect
    sql = _DRIVER_SQL.get(dialect)
    if sql is None:
        sql = _DRIVER_SQL[dialect] = str(_insert(dialect.name).compile(dialect=dialect))
    return sql


def _now(dialect: str) -> datetime:
    now = datetime.now(UTC)
    return now.replace(tzinfo=None) if dialect == "sqlite" else now


class _Guard:
    """The dedupe logic of one decorated handler, for its four flavours."""

    def __init__(
        self,
        group: str,
        key: Callable[[MessageExt], str],
        ttl: timedelta,
        on_duplicate: Callable[[MessageExt, str], None] | None,
    ) -> None:
        self.group = group
        self.key_of = key
        self.ttl = ttl
        self.on_duplicate = on_duplicate

    def duplicate(self, msg: MessageExt, k: str) -> ConsumeResult:
        """A duplicate was skipped: log it, tell ``on_duplicate``; acknowledge it."""
        log.debug("%s: duplicate %r (message %s) skipped", self.group, k, msg.msg_id)
        observe.duplicate_skipped(self.group)
        if self.on_duplicate is not None:
            self.on_duplicate(msg, k)
        return ConsumeResult.SUCCESS

    def key(self, msg: MessageExt) -> str:
        k = self.key_of(msg)
        if not isinstance(k, str) or not k:
            raise ValueError(f"dedupe key of message {msg.msg_id} must be a non-empty str")
        if len(k) > MAX_KEY_LENGTH:
            k = "sha256:" + hashlib.sha256(k.encode()).hexdigest()
        return k

    def _where(self, k: str) -> Any:
        t = consumed_keys
        return (t.c.consumer_group == self.group) & (t.c.key == k)

    # -- transaction mode ------------------------------------------------------------------

    def _done_row(self, conn: Connection, k: str) -> tuple[Any, dict[str, Any]]:
        """The statement and parameters that insert ``k`` as done (transaction mode)."""
        dialect = conn.dialect.name
        params = {"g": self.group, "k": k, "s": DONE, "e": None, "c": _now(dialect)}
        return _insert(dialect), params

    def _first_time(self, conn: Connection, k: str) -> bool:
        """Insert ``k`` as done in ``conn``'s transaction: whether it was not there."""
        stmt, params = self._done_row(conn, k)
        sql = _driver_sql(conn)
        if sql is not None:
            driver: Any = conn.connection.driver_connection
            return driver.execute(sql, params).fetchone() is not None
        return inserted(conn.execute(stmt, params))  # Core: lighter than the ORM's execute

    async def _first_time_async(self, conn: AsyncConnection, k: str) -> bool:
        """:meth:`_first_time` on an async connection."""
        sync = conn.sync_connection
        assert sync is not None  # a session's connection: begun
        stmt, params = self._done_row(sync, k)
        sql = _driver_sql(sync)
        if sql is not None:
            driver: Any = sync.connection.driver_connection
            cursor = await driver.execute(sql, params)
            return await cursor.fetchone() is not None
        return inserted(await conn.execute(stmt, params))

    def tx(self, handler: Callable[..., Any], factory: Any) -> Callable[[MessageExt], Any]:
        def listener(msg: MessageExt) -> ConsumeResult:
            k = self.key(msg)
            with factory() as session:
                try:
                    if not self._first_time(session.connection(), k):
                        session.rollback()
                        return self.duplicate(msg, k)
                    failed = _failed(handler(msg, session))
                    if failed is not None:
                        session.rollback()
                        return failed
                    session.commit()
                except BaseException:
                    session.rollback()
                    raise
            return ConsumeResult.SUCCESS

        return listener

    def async_tx(self, handler: Callable[..., Any], factory: Any) -> Callable[[MessageExt], Any]:
        async def listener(msg: MessageExt) -> ConsumeResult:
            k = self.key(msg)
            session: AsyncSession
            async with factory() as session:
                try:
                    if not await self._first_time_async(await session.connection(), k):
                        await session.rollback()
                        return self.duplicate(msg, k)
                    failed = _failed(await handler(msg, session))
                    if failed is not None:
                        await session.rollback()
                        return failed
                    await session.commit()
                except BaseException:
                    await session.rollback()
                    raise
            return ConsumeResult.SUCCESS

        return listener

    # -- mark mode -------------------------------------------------------------------------

    def _take(self, conn: Connection, k: str) -> datetime | str:
        """Take the mark: its expiry (our token) if taken, else "done" or "busy"."""
        t = consumed_keys
        dialect = conn.dialect.name
        now = _now(dialect)
        expires = now + self.ttl
        with conn.begin():
            row = {"g": self.group, "k": k, "s": CONSUMING, "e": expires, "c": now}
            if inserted(conn.execute(_insert(dialect), row)):
                return expires
            taken = conn.execute(
                update(t)
                .where(self._where(k), t.c.state == CONSUMING, t.c.expires_at <= now)
                .values(expires_at=expires)
            ).rowcount
            if taken == 1:
                log.info("%s: took over the expired mark of %r", self.group, k)
                return expires
            state = conn.execute(select(t.c.state).where(self._where(k))).scalar()
            return "done" if state == DONE else "busy"

    def _finish(self, conn: Connection, k: str, token: datetime, ok: bool) -> None:
        t = consumed_keys
        mine = self._where(k) & (t.c.state == CONSUMING) & (t.c.expires_at == token)
        with conn.begin():
            if ok:
                n = conn.execute(update(t).where(mine).values(state=DONE, expires_at=None))
                if n.rowcount != 1:
                    log.warning(
                        "%s: the mark of %r expired while its handler ran (another consumer "
                        "may have run it too); make expiry longer",
                        self.group,
                        k,
                    )
            else:
                conn.execute(delete(t).where(mine))  # released: the retry may start at once

    def _verdict(self, got: datetime | str, msg: MessageExt, k: str) -> ConsumeResult | None:
        if got == "done":
            return self.duplicate(msg, k)
        if got == "busy":
            log.info("%s: %r is being consumed elsewhere; later", self.group, k)
            return ConsumeResult.RECONSUME_LATER
        return None

    def mark(self, handler: Callable[..., Any], factory: Any) -> Callable[[MessageExt], Any]:
        engine: Engine = _engine_of(factory)

        def listener(msg: MessageExt) -> ConsumeResult:
            k = self.key(msg)
            with engine.connect() as conn:
                got = self._take(conn, k)
            verdict = self._verdict(got, msg, k)
            if verdict is not None:
                return verdict
            assert isinstance(got, datetime)
            failed: ConsumeResult | None = ConsumeResult.RECONSUME_LATER
            try:
                failed = _failed(handler(msg))
            finally:
                with engine.connect() as conn:
                    self._finish(conn, k, got, failed is None)
            return failed or ConsumeResult.SUCCESS

        return listener

    def async_mark(
        self, handler: Callable[..., Awaitable[Any]], factory: Any
    ) -> Callable[[MessageExt], Any]:
        engine: AsyncEngine = _engine_of(factory)

        async def listener(msg: MessageExt) -> ConsumeResult:
            k = self.key(msg)
            async with engine.connect() as conn:
                got = await conn.run_sync(self._take, k)
            verdict = self._verdict(got, msg, k)
            if verdict is not None:
                return verdict
            assert isinstance(got, datetime)
            failed: ConsumeResult | None = ConsumeResult.RECONSUME_LATER
            try:
                failed = _failed(await handler(msg))
            finally:
                async with engine.connect() as conn:
                    await conn.run_sync(self._finish, k, got, failed is None)
            return failed or ConsumeResult.SUCCESS

        return listener


def cleanup_consumed_keys(
    conn: Connection,
    older_than: timedelta,
    *,
    group: str | None = None,
    batch_size: int = 10_000,
) -> int:
    """Delete consumed keys older than ``older_than`` (of ``group``, or all), in batches
    each committed; returns how many. Keep them longer than a duplicate can still arrive
    (the broker's retries span about 4.5 hours with the default delay levels, a producer
    or relay may re-send after an outage): a duplicate older than that is applied again.
    ``txmq db cleanup --url URL --table consumed-keys`` runs it."""
    if older_than <= timedelta(0):
        raise ValueError("older_than must be positive")
    t = consumed_keys
    cutoff = _now(conn.dialect.name) - older_than
    total = 0
    while True:
        q = select(t.c.consumer_group, t.c.key).where(t.c.created_at < cutoff)
        if group is not None:
            q = q.where(t.c.consumer_group == group)
        batch = conn.execute(q.limit(batch_size)).all()
        if conn.in_transaction():
            conn.commit()
        if not batch:
            return total
        with conn.begin():
            for g in {g for g, _ in batch}:
                keys = [k for gg, k in batch if gg == g]
                conn.execute(delete(t).where(t.c.consumer_group == g, t.c.key.in_(keys)))
        total += len(batch)
        if len(batch) < batch_size:
            return total
