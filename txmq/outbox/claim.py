"""The relay's database side: claim the rows to send, then mark what became of them.

A cycle:

1. **claim**, in one statement: the *head* of each sharding key — its oldest pending row
   — if it is due (``next_attempt_at`` passed) and no other relay holds it, and the
   claimed keys' further pending rows (in ``id`` order). Rows without a key are all
   heads, claimed one by one.

   - PostgreSQL: the heads are taken with ``SELECT ... FOR UPDATE SKIP LOCKED`` and the
     transaction stays open while the relay sends; a head's row lock is its key's lock,
     so no two relays ever work on one key, and a key's next rows are not a head until
     its head is marked. Row locks never hold up the application's inserts.
   - SQLite has one lock for the whole database, and the application's writes would wait
     for it (and fail after their busy timeout) while the relay waits on the broker. So
     the claim is a **lease**: under ``BEGIN IMMEDIATE`` the claimed rows'
     ``next_attempt_at`` moves ``lease`` ahead and the transaction commits at once. A
     leased key is not due for anyone (as if backing off) until the lease ends.
2. the relay sends them (see :mod:`outbox.relay`), holding no SQLite lock;
3. **mark**: sent rows become ``sent`` (or are deleted), a failed row gets ``attempts + 1``,
   its error and a backoff (or is parked after ``max_attempts``), a row neither sent nor
   failed (a broker outage, a key stopped at a failure) is due again at once; commit. A
   crash before that leaves the rows pending: they are sent again (at least once) — on
   PostgreSQL at once, on SQLite when the lease ends.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    Connection,
    DateTime,
    Interval,
    bindparam,
    case,
    delete,
    func,
    literal_column,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.util import await_only

from txmq.outbox.store import utcnow
from txmq.sqla.checker import begin_immediate
from txmq.sqla.db import on_psycopg
from txmq.sqla.tables import OUTBOX_PARKED, OUTBOX_PENDING, OUTBOX_SENT, outbox

__all__ = ["ASYNC_COMMIT", "Outcome", "Pipelined", "Row", "claim", "mark"]

# a literal, not a bind parameter: PostgreSQL then uses the partial "pending" indexes even
# in a generic plan
_PENDING: ColumnElement[Any] = literal_column(f"'{OUTBOX_PENDING}'")

WINDOW_BATCHES = 4
"""Heads are looked for among the oldest ``WINDOW_BATCHES * batch_size`` pending rows."""


@dataclass(frozen=True, slots=True)
class Row:
    """An outbox row as the relay sends it."""

    id: int
    msg_id: str
    topic: str
    sharding_key: str | None
    tags: str | None
    keys: str | None
    properties: dict[str, str] | None
    body: bytes
    attempts: int


@dataclass
class Outcome:
    """What a cycle's sends came to."""

    sent: list[int] = field(default_factory=list)
    failed: list[tuple[Row, BaseException]] = field(default_factory=list)
    outage: BaseException | None = None
    """A broker outage (unreachable, timeout, busy): rows it hit are left as they were,
    without counting an attempt."""
    more: bool = False
    """The relay claims again at once (rows may be waiting that no notification will
    announce again)."""


_COLUMNS = (
    outbox.c.id,
    outbox.c.msg_id,
    outbox.c.topic,
    outbox.c.sharding_key,
    outbox.c.tags,
    outbox.c["keys"],
    outbox.c.properties,
    outbox.c.body,
    outbox.c.attempts,
)


def claim(conn: Connection, batch_size: int, lease: timedelta) -> list[Row]:
    """Claim up to ``batch_size`` rows, in ``id`` order.

    PostgreSQL: leaves the cycle's transaction open (the claimed heads locked); the caller
    sends, then calls :func:`mark` and commits (or rolls back: the rows stay pending).
    SQLite: leases the rows for ``lease`` and commits; :func:`mark` begins anew.
    """
    dialect = conn.dialect.name
    if dialect == "sqlite":
        begin_immediate(conn)
    stmt = _CLAIMS.get((dialect, batch_size))
    if stmt is None:
        stmt = _CLAIMS[(dialect, batch_size)] = _claim_statement(dialect, batch_size)
    now = utcnow(conn)
    rows = [Row(*r) for r in conn.execute(stmt, {"now": now})]
    if dialect == "sqlite":
        if rows:
            ids = [r.id for r in rows]
            conn.execute(_LEASE, {"ids": ids, "until": now + lease})
        conn.commit()
    return rows


_CLAIMS: dict[tuple[str, int], Any] = {}  # built once: building it costs more than running it


def _claim_statement(dialect: str, batch_size: int) -> Any:
    o = outbox
    # A key's head is its smallest pending id. Heads are looked for among the oldest
    # pending rows of keys not backing off only (a window a few batches long), which
    # always hold the whole past of any key seen in them: the smallest id of a key in the
    # window is its head. Keys whose oldest row lies beyond the window wait for older rows
    # to go first; a key backing off (or parking) never fills the window and stalls the
    # others. Rows without a key are each their own head.
    # PostgreSQL: the database's clock decides what is due; SQLite: the relay's
    now = func.now() if dialect == "postgresql" else bindparam("now", type_=DateTime())
    # keys whose head is backing off: all their rows wait (only a head ever backs off)
    blocked = select(o.c.sharding_key).where(
        o.c.state == _PENDING,
        o.c.next_attempt_at.is_not(None),
        o.c.next_attempt_at > now,
        o.c.sharding_key.is_not(None),
    )
    w = (
        select(o.c.id, o.c.sharding_key)
        .where(
            o.c.state == _PENDING,
            or_(o.c.next_attempt_at.is_(None), o.c.next_attempt_at <= now),
            or_(o.c.sharding_key.is_(None), o.c.sharding_key.not_in(blocked)),
        )
        .order_by(o.c.id)
        .limit(max(1, batch_size * WINDOW_BATCHES))
        .subquery("window")
    )
    unkeyed_apart = case((w.c.sharding_key.is_(None), w.c.id))
    head_ids = select(func.min(w.c.id)).group_by(w.c.sharding_key, unkeyed_apart)
    heads_q = (
        select(o.c.id, o.c.sharding_key)
        .where(
            o.c.id.in_(head_ids),
            o.c.state == _PENDING,  # re-checked under the lock: another relay may be done
            or_(o.c.next_attempt_at.is_(None), o.c.next_attempt_at <= now),
        )
        .order_by(o.c.id)
        .limit(batch_size)
    )
    if dialect == "postgresql":
        heads_q = heads_q.with_for_update(skip_locked=True, of=o)
    heads = heads_q.cte("heads")
    # One statement: the claimed heads (locked in the CTE) and, for the claimed keys, their
    # further pending rows within the window (only a key's head can be backing off, so
    # all of these are due); bounding them by the window keeps a deep backlog cheap.
    edge = select(func.max(w.c.id)).scalar_subquery()
    unkeyed = select(*_COLUMNS).where(
        o.c.id.in_(select(heads.c.id).where(heads.c.sharding_key.is_(None)))
    )
    keyed = select(*_COLUMNS).where(
        o.c.state == _PENDING,
        o.c.id <= edge,
        o.c.sharding_key.in_(select(heads.c.sharding_key).where(heads.c.sharding_key.isnot(None))),
    )
    both = union_all(unkeyed, keyed).subquery("claimed")
    return select(both).order_by(both.c.id).limit(batch_size)


def backoff_delay(attempts: int, base: float, cap: float) -> float:
    """Seconds before attempt ``attempts + 1``: ``base * 2 ** (attempts - 1)``, capped."""
    return float(min(cap, base * 2 ** max(0, attempts - 1)))


def mark(
    conn: Connection,
    outcome: Outcome,
    *,
    max_attempts: int,
    backoff: float,
    max_backoff: float,
    delete_sent: bool,
    claimed: list[Row],
    async_commit: bool = False,
) -> list[int]:
    """Record the outcome of sending the ``claimed`` rows in the cycle's transaction (on
    SQLite a new one; the caller commits); returns the ids of the rows parked now.
    ``async_commit`` (PostgreSQL): the commit will not wait for the disk (see
    :data:`ASYNC_COMMIT`)."""
    o = outbox
    postgres = conn.dialect.name == "postgresql"
    if not postgres:
        begin_immediate(conn)
        done = set(outcome.sent) | {row.id for row, _ in outcome.failed}
        unsent = [r.id for r in claimed if r.id not in done]
        if unsent:  # their lease ends now: due again (an outage, a key stopped at a failure)
            conn.execute(_RELEASE, {"ids": unsent})
    if outcome.sent:
        ids = sorted(outcome.sent)
        if postgres:
            _unprepared(conn, _DELETE_SENT[True] if delete_sent else _MARK_SENT[True], ids)
        else:
            params = {"ids": ids, "now": utcnow(conn)}
            conn.execute((_DELETE_SENT if delete_sent else _MARK_SENT)[False], params)
    parked: list[int] = []
    for row, exc in outcome.failed:
        attempts = row.attempts + 1
        error = f"{type(exc).__name__}: {exc}"[:2000]
        if attempts >= max_attempts:
            parked.append(row.id)
            values: dict[str, Any] = {"state": OUTBOX_PARKED, "next_attempt_at": None}
        else:
            delay = timedelta(seconds=backoff_delay(attempts, backoff, max_backoff))
            if postgres:
                due: Any = func.clock_timestamp() + bindparam("delay", delay, type_=Interval())
            else:
                due = utcnow(conn) + delay
            values = {"state": OUTBOX_PENDING, "next_attempt_at": due}
        conn.execute(
            update(o).where(o.c.id == row.id).values(attempts=attempts, last_error=error, **values)
        )
    if async_commit and postgres:
        conn.execute(text(f"SET LOCAL {ASYNC_COMMIT}"))
    return parked


def _unprepared(conn: Connection, stmt: Any, ids: list[int]) -> None:
    """Run the mark ``stmt`` for the rows ``ids`` planned for these ids, not as a prepared
    statement: psycopg prepares a statement run often, and PostgreSQL then keeps the plan
    it made for the table as it was — on a new outbox, a scan of the whole table, which
    took 10 ms per mark after 10,000 rows, until an ANALYZE (autovacuum's, a minute or
    more later) replaces it.  On psycopg's own connection (another driver, or a
    connection that maps schemas, through SQLAlchemy: its driver decides)."""
    if not on_psycopg(conn):
        conn.execute(stmt, {"ids": ids})
        return
    sql, params = _driver_statement(conn.dialect, stmt)
    driver: Any = conn.connection.driver_connection
    done = driver.execute(sql, {**params, "ids": ids}, prepare=False)
    if inspect.isawaitable(done):  # psycopg's AsyncConnection, in SQLAlchemy's run_sync
        await_only(done)


def _driver_statement(dialect: Any, stmt: Any) -> tuple[str, dict[str, Any]]:
    """``stmt``'s SQL for ``dialect``'s driver and its bound values, compiled once."""
    found = _COMPILED.get((dialect, stmt))
    if found is None:
        compiled = stmt.compile(dialect=dialect)
        found = _COMPILED[(dialect, stmt)] = (str(compiled), dict(compiled.params))
    return found


_COMPILED: dict[tuple[Any, Any], tuple[str, dict[str, Any]]] = {}


ASYNC_COMMIT = "synchronous_commit TO OFF"
"""The relay's commits on PostgreSQL do not wait for the disk: a mark lost in a crash of
the database leaves its rows pending, and they are sent again — as after a relay's crash
before its commit, which consumers already deduplicate.  (The application's transactions,
the rows' inserts, keep the server's setting.)"""


_SENT_IDS = outbox.c.id.in_(bindparam("ids", expanding=True))
# PostgreSQL: one array parameter, so that the statement's text is the same every cycle
# (the driver prepares it, the server plans it once) whatever the number of rows
_SENT_ID_ARRAY = outbox.c.id == func.any(bindparam("ids", type_=ARRAY(BigInteger)))
_DELETE_SENT = {
    postgres: delete(outbox).where(_SENT_ID_ARRAY if postgres else _SENT_IDS)
    for postgres in (True, False)
}
_LEASE = (
    update(outbox).where(_SENT_IDS).values(next_attempt_at=bindparam("until", type_=DateTime()))
)
_RELEASE = (
    update(outbox).where(_SENT_IDS, outbox.c.state == OUTBOX_PENDING).values(next_attempt_at=None)
)
_MARK_SENT = {  # PostgreSQL: the database's clock, when the mark is written
    postgres: update(outbox)
    .where(_SENT_ID_ARRAY if postgres else _SENT_IDS)
    .values(
        next_attempt_at=None,
        state=OUTBOX_SENT,
        sent_at=func.clock_timestamp() if postgres else bindparam("now", type_=DateTime()),
    )
    for postgres in (True, False)
}


class Pipelined:
    """A cycle's statements on psycopg's own async connection to PostgreSQL, in pipeline
    mode: BEGIN and the claim leave in one write and come back in one read, and so do the
    mark of the sent rows and COMMIT — two round trips a cycle instead of four, without
    SQLAlchemy's execution around each (``bench/outbox_bench.py``: the relay's CPU at 5,000
    rows/s went from 39 % to 33 % of a core).  Failed rows are marked through SQLAlchemy,
    by :func:`mark`, in the same transaction.  The SQL is SQLAlchemy's for the dialect."""

    def __init__(self, dialect: Any, batch_size: int) -> None:
        claim_stmt = _claim_statement("postgresql", batch_size).compile(dialect=dialect)
        self._claim = str(claim_stmt)
        self._claim_params = dict(claim_stmt.params)
        self._dialect = dialect

    @staticmethod
    def usable(conn: Connection) -> bool:
        """Whether ``conn`` (the sync side of an async connection) is psycopg's, to
        PostgreSQL, with pipelines (libpq 14), and maps no schemas."""
        if conn.dialect.name != "postgresql" or not on_psycopg(conn):
            return False
        import psycopg

        return bool(psycopg.Pipeline.is_supported())

    async def claim(self, driver: Any) -> list[Row]:
        """:func:`claim` (PostgreSQL) on ``driver``: the transaction stays open."""
        async with driver.pipeline():
            cursor = await driver.execute(self._claim, self._claim_params)
            found = await cursor.fetchall()
        rows = []
        for id_, msg_id, topic, key, tags, keys, props, body, attempts in found:
            if isinstance(props, str):  # (psycopg parses json; text if its loader was changed)
                props = json.loads(props)
            rows.append(Row(id_, msg_id, topic, key, tags, keys, props, body, attempts))
        return rows

    async def finish(
        self, driver: Any, sent: list[int], *, delete_sent: bool, async_commit: bool
    ) -> None:
        """Mark (or delete) the ``sent`` rows, then commit: in one round trip."""
        async with driver.pipeline():
            if sent:
                stmt = _DELETE_SENT[True] if delete_sent else _MARK_SENT[True]
                sql, params = _driver_statement(self._dialect, stmt)
                await driver.execute(sql, {**params, "ids": sorted(sent)}, prepare=False)
            if async_commit:
                await driver.execute(f"SET LOCAL {ASYNC_COMMIT}")
            await driver.commit()
