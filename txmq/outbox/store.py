"""Adding messages to the outbox inside your SQLAlchemy transaction, and looking after it.

::

    with Session(engine) as session, session.begin():
        session.add(Order(id=order_id, amount=42))
        outbox.add(session, Message("orders", body, keys=[f"order-{order_id}-created"]),
                   sharding_key=order_id)

    async with AsyncSession(aengine) as session, session.begin():
        session.add(Order(...))
        await outbox.add_async(session, Message(...), sharding_key=order_id)

The row is inserted through your session: it commits or rolls back with your rows. On
PostgreSQL the same transaction also runs ``pg_notify('txmq_outbox', '')`` (once per
transaction), so relays wake the moment it commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from txmq.client.producer import check_message
from txmq.observability import hooks as observe
from txmq.protocol.message import Message, new_message_id
from txmq.sqla.tables import OUTBOX_PARKED, OUTBOX_PENDING, OUTBOX_SENT, outbox

__all__ = [
    "CHANNEL",
    "OutboxStats",
    "add",
    "add_async",
    "add_many",
    "add_many_async",
    "cleanup",
    "parked",
    "requeue",
    "stats",
]

CHANNEL = "txmq_outbox"
"""The PostgreSQL LISTEN/NOTIFY channel relays listen on."""

_NOTIFIED = "txmq_outbox_notified"  # session.info: the transaction that already notified


def add(session: Session, msg: Message, *, sharding_key: str | None = None) -> str:
    """Add ``msg`` to the outbox in ``session``'s transaction; returns its message id.

    Messages of one ``sharding_key`` reach the broker in the order they were added (and
    land on one queue); messages without a key go in any order. The message id is fixed
    now and is the same on every re-send, so a consumer can deduplicate on it; a message
    without keys also gets it as its key (``txmq.idempotent``'s default dedupe key).
    """
    return add_many(session, [msg], sharding_key=sharding_key)[0]


def add_many(
    session: Session, msgs: Sequence[Message], *, sharding_key: str | None = None
) -> list[str]:
    """Add several messages (one INSERT), in order; returns their message ids."""
    if not isinstance(session, Session):
        raise TypeError(_wrong_session(session, "add_async"))
    rows = _rows(msgs, sharding_key, session.get_bind().dialect.name)
    if rows:
        session.execute(insert(outbox), rows)
        if _should_notify(session):
            session.execute(_NOTIFY)
    return [r["msg_id"] for r in rows]


async def add_async(session: AsyncSession, msg: Message, *, sharding_key: str | None = None) -> str:
    """:func:`add` for an :class:`AsyncSession`."""
    return (await add_many_async(session, [msg], sharding_key=sharding_key))[0]


async def add_many_async(
    session: AsyncSession, msgs: Sequence[Message], *, sharding_key: str | None = None
) -> list[str]:
    """:func:`add_many` for an :class:`AsyncSession`."""
    if not isinstance(session, AsyncSession):
        raise TypeError(_wrong_session(session, "add"))
    rows = _rows(msgs, sharding_key, session.sync_session.get_bind().dialect.name)
    if rows:
        await session.execute(insert(outbox), rows)
        if _should_notify(session.sync_session):
            await session.execute(_NOTIFY)
    return [r["msg_id"] for r in rows]


_NOTIFY = text(f"SELECT pg_notify('{CHANNEL}', '')")


def _wrong_session(session: Any, other: str) -> str:
    return (
        f"expected a SQLAlchemy {'Session' if other == 'add_async' else 'AsyncSession'}, "
        f"got {type(session).__name__}; use outbox.{other}() for that kind of session"
    )


def _should_notify(session: Session) -> bool:
    if session.get_bind().dialect.name != "postgresql":
        return False
    tx = session.get_nested_transaction() or session.get_transaction()
    if session.info.get(_NOTIFIED) is tx:
        return False  # notifications of one transaction are delivered once anyway
    session.info[_NOTIFIED] = tx
    return True


def _rows(msgs: Sequence[Message], sharding_key: str | None, dialect: str) -> list[dict[str, Any]]:
    if isinstance(msgs, Message):
        raise TypeError("add_many() takes a list of messages; use add() for one")
    if sharding_key is not None:
        sharding_key = str(sharding_key)
        if not 0 < len(sharding_key) <= 255:
            raise ValueError("sharding_key must be 1 to 255 characters")
    now: datetime | None = None
    if dialect == "sqlite":  # CURRENT_TIMESTAMP has whole seconds only; lag needs better
        now = datetime.now(UTC).replace(tzinfo=None)
    rows = []
    for msg in msgs:
        _check(msg)
        msg_id = new_message_id()
        keys = msg.key_list() or [msg_id]
        row: dict[str, Any] = {
            "msg_id": msg_id,
            "topic": msg.topic,
            "sharding_key": sharding_key,
            "tags": msg.tags or None,
            "keys": " ".join(keys),
            "properties": _properties(msg),
            "body": bytes(msg.body),
        }
        if now is not None:
            row["created_at"] = now
        rows.append(row)
    return rows


def _properties(msg: Message) -> dict[str, str] | None:
    """The row's user properties: the message's, and the trace context current now (the
    relay's send continues that trace)."""
    props = dict(msg.properties)
    observe.capture(props)
    return props or None


def _check(msg: Message) -> None:
    """What the producer would refuse, refused now, inside the business transaction."""
    if not isinstance(msg, Message):
        raise TypeError(f"expected a txmq Message, got {type(msg).__name__}")
    check_message(msg)
    if msg.delay_level:
        raise ValueError("delayed messages cannot go through the outbox (delay_level must be 0)")
    if msg.tags is not None and len(msg.tags) > 255:
        raise ValueError("tags must be at most 255 characters")
    msg.wire_properties("")  # checks user properties: str to str, no reserved names


# -- operations ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutboxStats:
    """What the outbox holds: ``lag_seconds`` is the age of the oldest unsent row (0 when
    none), ``backlog`` the number of unsent rows (including those backing off)."""

    backlog: int
    lag_seconds: float
    parked: int
    sent: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "backlog": self.backlog,
            "lag_seconds": round(self.lag_seconds, 3),
            "parked": self.parked,
            "sent": self.sent,
        }


def utcnow(conn: Connection) -> datetime:
    """Now, as this database's DateTime columns hold it (naive UTC on SQLite)."""
    now = datetime.now(UTC)
    return now.replace(tzinfo=None) if conn.dialect.name == "sqlite" else now


def pending_lag(conn: Connection) -> tuple[int, float]:
    """(backlog, lag in seconds) of the pending rows."""
    o = outbox
    q = select(func.count(), func.min(o.c.created_at)).where(o.c.state == OUTBOX_PENDING)
    count, oldest = conn.execute(q).one()
    if not count or oldest is None:
        return 0, 0.0
    if conn.dialect.name == "postgresql":
        lag = conn.execute(
            select(func.extract("epoch", func.clock_timestamp() - oldest))
        ).scalar_one()
        return int(count), max(0.0, float(lag))
    if oldest.tzinfo is not None:
        oldest = oldest.astimezone(UTC).replace(tzinfo=None)
    return int(count), max(0.0, (utcnow(conn) - oldest).total_seconds())


def stats(conn: Connection) -> OutboxStats:
    """Backlog, lag, parked and sent (not yet cleaned up) rows, on a connection."""
    backlog, lag = pending_lag(conn)
    counts: dict[str, int] = dict(
        conn.execute(
            select(outbox.c.state, func.count())
            .where(outbox.c.state.in_([OUTBOX_PARKED, OUTBOX_SENT]))
            .group_by(outbox.c.state)
        ).all()
    )
    return OutboxStats(
        backlog, lag, int(counts.get(OUTBOX_PARKED, 0)), int(counts.get(OUTBOX_SENT, 0))
    )


def cleanup(conn: Connection, older_than: timedelta, *, batch_size: int = 10_000) -> int:
    """Delete sent rows sent more than ``older_than`` ago, in batches (each committed);
    returns how many. Pending and parked rows are never deleted."""
    if older_than < timedelta(0):
        raise ValueError("older_than must not be negative")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    cutoff = utcnow(conn) - older_than
    o = outbox
    total = 0
    while True:
        ids = (
            select(o.c.id)
            .where(o.c.state == OUTBOX_SENT, o.c.sent_at < cutoff)
            .order_by(o.c.id)
            .limit(batch_size)
            .scalar_subquery()
        )
        with _tx(conn):
            deleted = conn.execute(delete(o).where(o.c.id.in_(ids))).rowcount
        total += deleted
        if deleted < batch_size:
            return total


def parked(conn: Connection, *, limit: int = 100) -> list[dict[str, Any]]:
    """Parked rows, oldest first (without their bodies)."""
    o = outbox
    q = (
        select(
            o.c.id,
            o.c.msg_id,
            o.c.topic,
            o.c.sharding_key,
            o.c.attempts,
            o.c.last_error,
            o.c.created_at,
        )
        .where(o.c.state == OUTBOX_PARKED)
        .order_by(o.c.id)
        .limit(limit)
    )
    return [dict(r._mapping) for r in conn.execute(q)]


def requeue(conn: Connection, ids: Sequence[int] | None = None) -> int:
    """Put parked rows (``ids``, or all when None) back to pending with 0 attempts; returns
    how many. They are sent after any newer rows of their key already sent."""
    o = outbox
    stmt = (
        update(o)
        .where(o.c.state == OUTBOX_PARKED)
        .values(state=OUTBOX_PENDING, attempts=0, next_attempt_at=None)
    )
    if ids is not None:
        stmt = stmt.where(o.c.id.in_(list(ids)))
    with _tx(conn):
        n = conn.execute(stmt).rowcount
        if n and conn.dialect.name == "postgresql":
            conn.execute(_NOTIFY)
    return int(n)


class _tx:
    """A transaction on ``conn``, committed at the end (joins one already begun)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.mine = not conn.in_transaction()

    def __enter__(self) -> None:
        if self.mine:
            self.conn.begin()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self.mine:
            return
        if exc_type is None:
            self.conn.commit()
        else:
            self.conn.rollback()
