"""The outbox page: for each producer database the console was started with (``--db``), its
outbox's backlog, lag, parked and sent rows and the parked rows themselves; and re-queuing
parked rows (one, or every parked row of a database).

The console asks through the outbox's own functions (:func:`txmq.outbox.stats`,
:func:`~txmq.outbox.parked`, :func:`~txmq.outbox.requeue`: what ``txmq outbox stats``,
``parked`` and ``requeue`` run), each on a short connection in a worker thread, never on
the event loop.  A database that cannot be read (down, no such SQLite file, no outbox
table yet) is one clear line on the page; the others are still shown.  A form names a
database by its place in the ``--db`` list, never by a URL: the console touches only the
databases it was started with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from txmq.console.actions import confirm, done, int_field, read_form, who
from txmq.console.web import error_page, page, state_of

__all__ = ["OutboxView", "outbox", "read_outboxes", "requeue"]

log = logging.getLogger("txmq.console")

#: parked rows shown per database
PARKED_MAX = 100
#: seconds a database may take to answer before the page says it did not
DB_TIMEOUT_S = 10.0
R = TypeVar("R")


class DatabaseError(Exception):
    """A database could not be read or changed; its text is the line the page shows."""


@dataclass(frozen=True)
class OutboxView:
    """What the page shows of one database."""

    #: its place in the --db list (what a form names)
    index: int
    #: its URL, password hidden
    database: str
    backlog: int = 0
    lag_seconds: float = 0.0
    parked: int = 0
    sent: int = 0
    #: the first :data:`PARKED_MAX` parked rows (id, msg_id, topic, sharding_key, attempts,
    #: last_error, created_at)
    parked_rows: list[dict[str, Any]] = field(default_factory=list)
    #: why it could not be read ("" when it was)
    error: str = ""


def shown_url(url: str) -> str:
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(not a database URL)"


def _missing_sqlite_file(url: str) -> str:
    """A line saying the SQLite file of ``url`` does not exist ("" otherwise): connecting
    would create an empty one."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        u = make_url(url)
    except ArgumentError:
        return ""
    name = u.database or ""
    if u.get_backend_name() != "sqlite" or name in ("", ":memory:") or name.startswith("file:"):
        return ""
    if Path(name).exists():
        return ""
    return f"{shown_url(url)}: no such database file ({name})"


def _on_connection(url: str, fn: Callable[[Any], R]) -> R:
    """``fn(connection)`` on a short connection to ``url`` (in a worker thread); a
    :class:`DatabaseError` with one line when that fails."""
    from sqlalchemy.exc import SQLAlchemyError

    from txmq.sqla.db import describe_db_error, with_connection

    missing = _missing_sqlite_file(url)
    if missing:
        raise DatabaseError(missing)
    try:
        return with_connection(url, fn)
    except SQLAlchemyError as exc:
        raise DatabaseError(describe_db_error(exc, url)) from exc
    except ImportError as exc:  # the URL's driver is not installed
        raise DatabaseError(f"{shown_url(url)}: its driver is not installed ({exc})") from exc
    except OSError as exc:
        raise DatabaseError(f"cannot reach {shown_url(url)}: {exc}") from exc


async def off_loop(url: str, fn: Callable[[Any], R], *, timeout: float = DB_TIMEOUT_S) -> R:
    """:func:`_on_connection` in a worker thread, given up (the thread is left to finish)
    after ``timeout`` seconds."""
    with anyio.move_on_after(timeout):
        return await anyio.to_thread.run_sync(_on_connection, url, fn, abandon_on_cancel=True)
    raise DatabaseError(f"{shown_url(url)} did not answer within {timeout:g} s")


def _stats_and_parked(conn: Any) -> tuple[Any, list[dict[str, Any]]]:
    from txmq.outbox import parked, stats

    return stats(conn), parked(conn, limit=PARKED_MAX)


async def _read_one(index: int, url: str) -> OutboxView:
    shown = shown_url(url)
    try:
        s, rows = await off_loop(url, _stats_and_parked)
    except DatabaseError as exc:
        return OutboxView(index, shown, error=str(exc))
    return OutboxView(
        index,
        shown,
        backlog=s.backlog,
        lag_seconds=s.lag_seconds,
        parked=s.parked,
        sent=s.sent,
        parked_rows=rows,
    )


async def read_outboxes(urls: Sequence[str]) -> list[OutboxView]:
    """Each database's outbox (read at the same time), in the order of ``urls``."""
    views: list[OutboxView | None] = [None] * len(urls)

    async def one(i: int, url: str) -> None:
        views[i] = await _read_one(i, url)

    async with anyio.create_task_group() as tg:
        for i, url in enumerate(urls):
            tg.start_soon(one, i, url)
    return [v for v in views if v is not None]


async def outbox(request: Request) -> Response:
    dbs = state_of(request).config.dbs
    views = await read_outboxes(dbs)
    return page(request, "outbox", {"views": views, "parked_max": PARKED_MAX})


async def requeue(request: Request) -> Response:
    """Put a parked row (``id``), or every parked row (``all=yes``), of database ``db``
    (its place in the --db list) back to pending: the relay sends it again."""
    form = await read_form(request)
    dbs = state_of(request).config.dbs
    index = int_field(form, "db")
    if not 0 <= index < len(dbs):
        raise HTTPException(400, f"no database number {index}: the console has {len(dbs)}")
    url = dbs[index]
    shown = shown_url(url)
    every = form.get("all") == "yes"
    row_id = None if every else int_field(form, "id")
    what = "every parked row" if every else f"parked row {row_id}"
    asked = confirm(
        request,
        form,
        f"Requeue {what} of the outbox in {shown}? The relay sends it to the broker again.",
    )
    if asked is not None:
        return asked

    def put_back(conn: Any) -> int:
        from txmq.outbox import requeue as requeue_rows

        return requeue_rows(conn, None if row_id is None else [row_id])

    try:
        n = await off_loop(url, put_back)
    except DatabaseError as exc:
        detail = str(exc)
        if "did not answer" in detail:
            detail += ": whether anything was requeued is not known; reload the page to see"
        return error_page(request, 503, "Database unavailable", detail)
    log.warning("operator %s: requeued %s of the outbox in %s: %d", who(request), what, shown, n)
    if n:
        return done(request, "/outbox", "ok", f"requeued {n} parked row(s) in {shown}")
    text = f"nothing was requeued in {shown}: " + (
        "no row is parked" if every else f"row {row_id} is not parked (any more)"
    )
    return done(request, "/outbox", "warn", text)
