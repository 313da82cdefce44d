"""What a coordinator's transaction reads, writes and sends: the saga row's statements
(built once: a statement built per transaction costs tens of microseconds to build and to
compute its cache key, every time), a decision's writes — the row's update conditioned on
the row as read, then the step log — and the messages a decision sends once it commits.
Shared by the coordinator's one-answer transactions and its group commits
(:mod:`txmq.saga.group`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import String, bindparam, func, insert, select, update

from txmq.client.producer import SendResult, not_yet_safe
from txmq.observability import hooks as observe
from txmq.protocol.message import FixedIdMessage, Message
from txmq.protocol.wire.errors import MessageNotFound, TxmqError
from txmq.saga.decide import Decision
from txmq.saga.model import REPLY_TOPIC, Command, State, command_topic, encode
from txmq.sqla.tables import saga_steps, sagas

__all__ = [
    "INSERT_SAGA",
    "INSERT_STEPS",
    "LAST",
    "SELECT",
    "SELECT_MANY",
    "STALE_TRIES",
    "Ended",
    "Stale",
    "changed",
    "committed",
    "ended",
    "message",
    "not_recalled",
    "outgoing",
    "raise_if_not_safe",
    "rows",
    "taken",
    "waits",
    "writes",
]

log = logging.getLogger("txmq.saga")


def message(cmd: Command) -> Message:
    key = f"{cmd.saga_id}/{cmd.step}/{cmd.op}"
    return Message(command_topic(cmd.service), encode(cmd), tags=cmd.op, keys=[key])


@dataclass(frozen=True)
class Ended:
    """A saga that has just ended, as the coordinator's ``on_end`` sees it."""

    saga_id: str
    #: the saga's name (its definition's)
    name: str
    #: COMPLETED or COMPENSATED
    state: str
    #: the data it started with, merged with each step's result
    data: dict[str, Any]
    #: why it compensated: the step that said no, failed or timed out, and its words
    error: str | None


def ended(row: Any, decision: Decision) -> Ended | None:
    state = decision.values.get("state")
    if state not in State.ENDED:
        return None
    values = decision.values
    return Ended(
        row.saga_id,
        row.name,
        state,
        dict(values.get("data", row.data)),
        values["error"] if "error" in values else row.error,
    )


def taken(last: Any, answered: tuple[str, str]) -> bool:
    """Whether the step log's latest answer (``last``) is this answer: its decision was
    taken, and the command it caused may not have left."""
    return last is not None and (last.command_id, last.event) == answered


def waits(row: Any) -> bool:
    """Whether the saga ``row`` waits on a command's answer."""
    return row is not None and row.command_id is not None and row.state not in State.ENDED


#: the saga's latest answer in its step log (parameter saga_id): the command it answered
#: and how (an operator's has no command)
LAST = (
    select(saga_steps.c.command_id, saga_steps.c.event)
    .where(saga_steps.c.saga_id == bindparam("saga_id"), saga_steps.c.event != "sent")
    .order_by(saga_steps.c.id.desc())
    .limit(1)
)


def raise_if_not_safe(sent: SendResult) -> None:
    """A command stored on a master but on no slave yet is not safe: its answer is
    delivered again (and the command sent again) rather than acknowledged on it."""
    unsafe = not_yet_safe(sent)
    if unsafe is not None:
        raise unsafe


def outgoing(decision: Decision, coordinator: str) -> list[Message]:
    """The messages a decision sends: its command, and the command's deadline (an answer
    to itself, delayed until then)."""
    out = [] if decision.command is None else [message(decision.command)]
    if decision.deadline is not None:
        expired, seconds, msg_id = decision.deadline
        key = f"{expired.saga_id}/{expired.step}/deadline"
        body = encode(expired)
        delay = timedelta(seconds=seconds)
        out.append(FixedIdMessage(REPLY_TOPIC.format(coordinator), body, tags="timeout",
                                  keys=[key], delay=delay, fixed_id=msg_id))  # fmt: skip
    return out


def not_recalled(msg_id: str, exc: TxmqError) -> None:
    """A deadline message its answer did not recall: delivered already (it finds the saga
    past its step and is ignored), or the broker could not be asked (then it comes, and is
    ignored the same way)."""
    if not isinstance(exc, MessageNotFound):
        log.warning(
            "could not recall deadline message %s (%s): it is ignored when due", msg_id, exc
        )


def committed(name: str, decision: Decision, before: str | None = None) -> None:
    """Metrics of a decision, once its transaction committed (``before``: the saga's state
    until then; None: it started)."""
    state = decision.values.get("state")
    if state is not None and state != before:
        observe.saga_state(name, state)
    if decision.took is not None:
        observe.saga_step(name, *decision.took)


class Stale(Exception):
    """The saga's row changed between this transaction's read and its write: another
    answer's transaction came in between (SQLite has no row locks: its SELECT ... FOR
    UPDATE locks nothing until the first write)."""


#: how many times an answer is decided on a row that changed meanwhile, before its
#: delivery fails (and comes again later)
STALE_TRIES = 5


# Statements built once: one built per transaction costs tens of microseconds to build and
# to compute its cache key, every time.
SELECT = select(sagas).where(sagas.c.saga_id == bindparam("saga_id")).with_for_update()
#: the rows of several sagas (parameter saga_ids), locked in one order (by id) whatever
#: the order asked in, so that two group commits never wait on each other's rows
SELECT_MANY = (
    select(sagas)
    .where(sagas.c.saga_id.in_(bindparam("saga_ids", expanding=True)))
    .order_by(sagas.c.saga_id)
    .with_for_update()
)
INSERT_SAGA = insert(sagas)
INSERT_STEPS = insert(saga_steps)
#: the row's update for each set of columns a decision changes
_UPDATES: dict[frozenset[str], Any] = {}


def update_of(columns: frozenset[str]) -> Any:
    """UPDATE the saga row's ``columns`` (parameters of those names) if the row is still as
    read (parameters ``read_saga_id``, ``read_state``, ``read_command_id``)."""
    stmt = _UPDATES.get(columns)
    if stmt is None:
        c = sagas.c
        stmt = (
            update(sagas)
            .where(
                c.saga_id == bindparam("read_saga_id"),
                c.state == bindparam("read_state"),
                c.command_id.is_not_distinct_from(bindparam("read_command_id", type_=String)),
            )
            .values(
                {**{name: bindparam(name) for name in sorted(columns)}, "updated_at": func.now()}
            )
        )
        _UPDATES[columns] = stmt
    return stmt


def rows(log: list[dict[str, Any]]) -> Any:
    """The step log's rows as an INSERT's parameters: one row as one statement's (a list of
    one is run as the driver's executemany, which costs several times as much)."""
    return log[0] if len(log) == 1 else log


def writes(row: Any, decision: Decision, *, steps: bool = True) -> list[tuple[Any, Any, bool]]:
    """The statements, parameters and whether each is conditioned on the row as read, of a
    decision that changes a saga's row: the row's update only if it is still as read (every
    decision changes its state or the command it waits for), then the step log (unless not
    ``steps``: a group commit writes its decisions' step logs in one statement)."""
    out: list[tuple[Any, Any, bool]] = []
    if decision.values:
        values = decision.values
        read = {
            "read_saga_id": row.saga_id,
            "read_state": row.state,
            "read_command_id": row.command_id,
        }
        out.append((update_of(frozenset(values)), {**values, **read}, True))
    if decision.log and steps:
        out.append((INSERT_STEPS, rows(decision.log), False))
    return out


def changed(result: Any, conditioned: bool, row: Any) -> None:
    """Raise :class:`Stale` when the row's update found the row no longer as read."""
    if conditioned and result.rowcount != 1:
        raise Stale(f"saga {row.saga_id} changed while an answer was decided")
