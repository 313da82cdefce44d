"""The sagas pages: for each producer database the console was started with (``--db``), its
sagas by state and the latest of them (``/sagas``, ``?state=PARKED`` for one state); one
saga with its step log — each command, each answer with how long it took and after how
many attempts, each operator's action with who and why (``/saga?db=N&id=ID``); and, for a
parked saga, an operator's retry or resolve with a reason (what ``txmq admin sagas retry``
and ``resolve`` do: the command goes through the broker as a transactional message).

Databases are read on short connections in worker threads (:func:`off_loop`), named in
forms by their place in the ``--db`` list, never by URL."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from txmq.console.actions import ask_with_reason, done, read_form, text_field, who
from txmq.console.outbox_page import DatabaseError, off_loop, shown_url
from txmq.console.web import error_page, page, state_of
from txmq.saga.model import State

__all__ = ["SagasView", "act", "saga", "sagas"]

log = logging.getLogger("txmq.console")

#: sagas listed per database
LIST_MAX = 100


@dataclass(frozen=True)
class SagasView:
    """What the list shows of one database."""

    index: int
    database: str
    #: sagas in each state (every state, 0 for none)
    counts: dict[str, int] = field(default_factory=dict)
    #: the latest :data:`LIST_MAX` (of the chosen state), most recently changed first
    rows: list[Any] = field(default_factory=list)
    error: str = ""


def _counts_and_rows(conn: Any, state: str | None) -> tuple[dict[str, int], list[Any]]:
    from sqlalchemy import func, select

    from txmq.saga.views import list_sagas
    from txmq.sqla.tables import sagas

    q = select(sagas.c.state, func.count()).group_by(sagas.c.state)
    counts = {s: 0 for s in State.ALL} | {s: int(n) for s, n in conn.execute(q)}
    return counts, list_sagas(conn, state=state, limit=LIST_MAX)


async def _read(index: int, url: str, state: str | None) -> SagasView:
    shown = shown_url(url)
    try:
        counts, rows = await off_loop(url, lambda conn: _counts_and_rows(conn, state))
    except DatabaseError as exc:
        return SagasView(index, shown, error=str(exc))
    return SagasView(index, shown, counts, rows)


def _state_param(request: Request) -> str | None:
    state = request.query_params.get("state") or None
    if state is not None and state not in State.ALL:
        raise HTTPException(400, f"state must be one of {', '.join(State.ALL)}")
    return state


async def sagas(request: Request) -> Response:
    dbs = state_of(request).config.dbs
    state = _state_param(request)
    views: list[SagasView | None] = [None] * len(dbs)

    async def one(i: int, url: str) -> None:
        views[i] = await _read(i, url, state)

    async with anyio.create_task_group() as tg:
        for i, url in enumerate(dbs):
            tg.start_soon(one, i, url)
    context = {"views": views, "state": state, "states": State.ALL, "list_max": LIST_MAX}
    return page(request, "sagas", context)


def _db(request: Request, raw: str) -> tuple[int, str]:
    dbs = state_of(request).config.dbs
    try:
        index = int(raw)
    except ValueError:
        raise HTTPException(400, "db must be a number") from None
    if not 0 <= index < len(dbs):
        raise HTTPException(400, f"no database number {index}: the console has {len(dbs)}")
    return index, dbs[index]


def _timed(steps: tuple[Any, ...]) -> list[dict[str, Any]]:
    """The step log, each answer with the time since its command was sent."""
    sent: dict[tuple[int, str], datetime] = {}
    out = []
    for e in steps:
        took = None
        if e.event == "sent":
            sent[(e.step, e.op)] = e.at
        elif (e.step, e.op) in sent:
            took = (e.at - sent[(e.step, e.op)]).total_seconds()
        out.append({"entry": e, "took": took})
    return out


async def saga(request: Request) -> Response:
    index, url = _db(request, request.query_params.get("db", ""))
    saga_id = request.query_params.get("id", "")
    if not saga_id:
        raise HTTPException(400, "id is missing")
    from txmq.saga.views import saga_info

    try:
        info = await off_loop(url, lambda conn: saga_info(conn, saga_id))
    except DatabaseError as exc:
        return error_page(request, 503, "Database unavailable", str(exc))
    if info is None:
        return error_page(request, 404, "No such saga", f"no saga {saga_id} in {shown_url(url)}")
    context = {"info": info, "db": index, "database": shown_url(url), "log": _timed(info.steps)}
    return page(request, "saga", context)


async def act(request: Request) -> Response:
    """``retry`` or ``resolve`` a parked saga (``db``, ``id``, ``action``), with the
    operator's reason, recorded in its step log."""
    form = await read_form(request)
    index, url = _db(request, text_field(form, "db"))
    saga_id = text_field(form, "id")
    action = text_field(form, "action")
    if action not in ("retry", "resolve"):
        raise HTTPException(400, "action must be retry or resolve")
    question = {
        "retry": f"Send the failing operation of saga {saga_id} again?",
        "resolve": f"Record that the failing operation of saga {saga_id} was done by hand, "
        "and let the saga go on?",
    }[action]
    reason = text_field(form, "reason", required=False)
    if form.get("confirm") != "yes" or not reason:
        return ask_with_reason(
            request, form, question, "Reason (recorded in the saga's step log)",
            missing=form.get("confirm") == "yes",
        )  # fmt: skip
    from txmq.saga.operate import operate

    config = state_of(request).config
    operator = f"console ({who(request)})"
    try:
        state = await operate(
            url, saga_id, action, operator=operator, reason=reason,  # type: ignore[arg-type]
            address=config.broker, namesrv=config.namesrv,
        )  # fmt: skip
    except (LookupError, ValueError) as exc:
        return done(request, "/saga", "warn", str(exc), db=str(index), id=saga_id)
    log.warning(
        "operator %s: %s saga %s (%s): now %s", who(request), action, saga_id, reason, state
    )
    text = f"saga {saga_id}: {action} recorded ({reason}); now {state}"
    return done(request, "/saga", "ok", text, db=str(index), id=saga_id)
