"""Sagas as an operator or a test reads them from the coordinator's database: one saga with
its step log, or a list (by state, newest first)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, select

from txmq.sqla.tables import saga_steps, sagas

__all__ = ["SagaInfo", "StepEntry", "list_sagas", "saga_info"]


@dataclass(frozen=True)
class StepEntry:
    """One line of a saga's step log: a command sent, an answer taken, or an operator's
    action (``op == "operator"``, ``detail`` "who: why")."""

    step: int
    branch: str
    op: str
    event: str
    attempts: int | None
    detail: str | None
    at: datetime


@dataclass(frozen=True)
class SagaInfo:
    saga_id: str
    name: str
    state: str
    #: the step it waits on (its action while RUNNING, its compensation after)
    step: int
    data: dict[str, Any]
    #: the steps whose actions took effect and are not undone
    effected: list[int]
    error: str | None
    created_at: datetime
    updated_at: datetime
    #: the step log, in order (empty in a list)
    steps: tuple[StepEntry, ...] = ()


def _info(row: Any, steps: tuple[StepEntry, ...] = ()) -> SagaInfo:
    return SagaInfo(
        saga_id=row.saga_id,
        name=row.name,
        state=row.state,
        step=row.step,
        data=dict(row.data),
        effected=list(row.effected),
        error=row.error,
        created_at=row.created_at,
        updated_at=row.updated_at,
        steps=steps,
    )


def saga_info(conn: Connection, saga_id: str) -> SagaInfo | None:
    """The saga ``saga_id`` with its step log; None when this database has no such saga."""
    row = conn.execute(select(sagas).where(sagas.c.saga_id == saga_id)).first()
    if row is None:
        return None
    t = saga_steps
    q = select(t).where(t.c.saga_id == saga_id).order_by(t.c.id)
    steps = tuple(
        StepEntry(r.step, r.branch, r.op, r.event, r.attempts, r.detail, r.at)
        for r in conn.execute(q)
    )
    return _info(row, steps)


def list_sagas(conn: Connection, *, state: str | None = None, limit: int = 100) -> list[SagaInfo]:
    """Sagas, most recently changed first (``state``: only those in it)."""
    q = select(sagas).order_by(sagas.c.updated_at.desc(), sagas.c.saga_id).limit(limit)
    if state is not None:
        q = q.where(sagas.c.state == state)
    return [_info(row) for row in conn.execute(q)]
