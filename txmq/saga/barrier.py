"""The sub-transaction barrier (DTM's), in a participant's database.

Every operation a participant runs for a saga first inserts a row (saga id, branch,
operation) in ``txmq_saga_barrier``, in the same local transaction as its effect, and runs
only if the row was not there:

- an action whose row is there already is a repeat: no second effect;
- a compensation inserts its action's row too (reason ``compensation``).  If that insert
  succeeds the action never took effect: the compensation has nothing to undo (a "null
  compensation"), and the action, should it still arrive, finds the row and does nothing
  (a "suspension");
- a compensation of an action that was refused or ran out of retries (its row says so)
  has nothing to undo either.

Two operations racing on one branch: the second insert waits for the first transaction
(PostgreSQL's primary-key lock; SQLite runs one writer at a time), then sees its row.

The action's row also keeps its answer (``answer``: the result it returned, or why it had
no effect), so that a repeat is answered as the first delivery was: the participant sends
its reply after its transaction commits, and a command delivered again because that reply
never left (the service died in between) finds the row and sends it again.
"""

from __future__ import annotations

import enum
from collections.abc import Generator
from typing import Any

from sqlalchemy import Connection, bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from txmq.saga.model import ACTION, COMPENSATION, CONFIRM
from txmq.sqla.tables import insert_if_absent, inserted, saga_barrier

__all__ = [
    "Entry",
    "enter",
    "enter_async",
    "keep",
    "keep_async",
    "kept",
    "kept_async",
    "record",
    "record_async",
]

#: the reasons of an action's row that mean it had no effect
NO_EFFECT = ("refused", "failed")


class Entry(enum.Enum):
    """What the barrier lets an operation do."""

    RUN = "run"
    #: this operation ran before (its answer was sent then)
    DUPLICATE = "duplicate"
    #: a compensation whose action never took effect: nothing to undo
    NULL = "null"
    #: an action whose compensation came first: it must not take effect now
    SUSPENDED = "suspended"


_INSERTS: dict[str, Any] = {}


def _insert(dialect: str) -> Any:
    """INSERT a barrier row unless it is there (parameters: saga_id, branch, op, reason)."""
    stmt = _INSERTS.get(dialect)
    if stmt is None:
        stmt = _INSERTS[dialect] = insert_if_absent(saga_barrier, dialect)
    return stmt


def _row(
    saga_id: str, branch: str, op: str, reason: str, answer: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"saga_id": saga_id, "branch": branch, "op": op, "reason": reason, "answer": answer}


# built once (parameters: of_saga_id, of_branch, of_op; and answer): a statement built per
# call costs tens of microseconds to build and to compute its cache key, every time
_t = saga_barrier
_ROW = (  # (not the columns' names: an UPDATE keeps those for its SET clause)
    _t.c.saga_id == bindparam("of_saga_id"),
    _t.c.branch == bindparam("of_branch"),
    _t.c.op == bindparam("of_op"),
)
_REASON = select(_t.c.reason).where(*_ROW)
_KEPT = select(_t.c.reason, _t.c.answer).where(*_ROW)
_KEEP = update(_t).where(*_ROW).values(answer=bindparam("answer"))


def _key(saga_id: str, branch: str, op: str) -> dict[str, str]:
    return {"of_saga_id": saga_id, "of_branch": branch, "of_op": op}


#: a barrier's decision as a series of statements: each yielded (statement, parameters) is
#: executed by the driver, which sends its result back; the return value is the answer
Plan = Generator[tuple[Any, Any], Any, Any]


def _enter(dialect: str, saga_id: str, branch: str, op: str) -> Plan:
    ins = _insert(dialect)
    if op == CONFIRM:  # TCC's confirm follows a try that took effect: once is all it needs
        done = inserted((yield ins, _row(saga_id, branch, CONFIRM, CONFIRM)))
        return Entry.RUN if done else Entry.DUPLICATE
    if op == ACTION:
        if inserted((yield ins, _row(saga_id, branch, ACTION, ACTION))):
            return Entry.RUN
        reason = (yield _REASON, _key(saga_id, branch, ACTION)).scalar()
        return Entry.SUSPENDED if reason == COMPENSATION else Entry.DUPLICATE
    origin = inserted((yield ins, _row(saga_id, branch, ACTION, COMPENSATION)))
    if not inserted((yield ins, _row(saga_id, branch, COMPENSATION, COMPENSATION))):
        return Entry.DUPLICATE
    if origin:
        return Entry.NULL
    reason = (yield _REASON, _key(saga_id, branch, ACTION)).scalar()
    return Entry.NULL if reason in NO_EFFECT else Entry.RUN


def _record(dialect: str, saga_id: str, branch: str, reason: str, detail: str) -> Plan:
    row = _row(saga_id, branch, ACTION, reason, {"detail": detail})
    return inserted((yield _insert(dialect), row))


def _keep(saga_id: str, branch: str, result: dict[str, Any]) -> Plan:
    yield _KEEP, {**_key(saga_id, branch, ACTION), "answer": {"result": result}}


def _kept(saga_id: str, branch: str) -> Plan:
    row = (yield _KEPT, _key(saga_id, branch, ACTION)).first()
    return None if row is None else (row.reason, row.answer or {})


def _run(conn: Connection, plan: Plan) -> Any:
    result = None
    try:
        while True:
            stmt, params = plan.send(result)
            result = conn.execute(stmt, params)
    except StopIteration as done:
        return done.value


async def _run_async(conn: AsyncConnection, plan: Plan) -> Any:
    result = None
    try:
        while True:
            stmt, params = plan.send(result)
            result = await conn.execute(stmt, params)
    except StopIteration as done:
        return done.value


def enter(conn: Connection, saga_id: str, branch: str, op: str) -> Entry:
    """Pass the barrier for ``op`` (action, compensation or confirm) of a branch, in ``conn``'s
    transaction (which then runs the operation's effect)."""
    entry: Entry = _run(conn, _enter(conn.dialect.name, saga_id, branch, op))
    return entry


async def enter_async(conn: AsyncConnection, saga_id: str, branch: str, op: str) -> Entry:
    """:func:`enter` on an async connection."""
    entry: Entry = await _run_async(conn, _enter(conn.dialect.name, saga_id, branch, op))
    return entry


def record(conn: Connection, saga_id: str, branch: str, reason: str, detail: str = "") -> bool:
    """Record that a branch's action had no effect (``reason``: refused or failed, and
    ``detail``, why); False when its row is there already (another delivery answered)."""
    return bool(_run(conn, _record(conn.dialect.name, saga_id, branch, reason, detail)))


async def record_async(
    conn: AsyncConnection, saga_id: str, branch: str, reason: str, detail: str = ""
) -> bool:
    """:func:`record` on an async connection."""
    plan = _record(conn.dialect.name, saga_id, branch, reason, detail)
    return bool(await _run_async(conn, plan))


def keep(conn: Connection, saga_id: str, branch: str, result: dict[str, Any]) -> None:
    """Keep what a branch's action returned with its row (its repeats answer with it)."""
    _run(conn, _keep(saga_id, branch, result))


async def keep_async(
    conn: AsyncConnection, saga_id: str, branch: str, result: dict[str, Any]
) -> None:
    """:func:`keep` on an async connection."""
    await _run_async(conn, _keep(saga_id, branch, result))


def kept(conn: Connection, saga_id: str, branch: str) -> tuple[str, dict[str, Any]] | None:
    """A branch's action row: its reason and the answer kept with it (None: no row)."""
    found: tuple[str, dict[str, Any]] | None = _run(conn, _kept(saga_id, branch))
    return found


async def kept_async(
    conn: AsyncConnection, saga_id: str, branch: str
) -> tuple[str, dict[str, Any]] | None:
    """:func:`kept` on an async connection."""
    found: tuple[str, dict[str, Any]] | None = await _run_async(conn, _kept(saga_id, branch))
    return found
