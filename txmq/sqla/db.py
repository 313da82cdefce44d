"""Short database connections for commands and jobs, and readable database errors."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.engine import URL
    from sqlalchemy.exc import SQLAlchemyError

# SQLAlchemy (and asyncio) are imported when a function runs, not with this module (the CLI
# imports it).

__all__ = ["async_url", "describe_db_error", "on_psycopg", "with_connection"]

R = TypeVar("R")


def async_url(db: str | URL) -> URL:
    """The async-driver form of a database URL (``sqlite:`` → ``sqlite+aiosqlite:``,
    ``postgresql:`` → ``postgresql+psycopg:``)."""
    from sqlalchemy import make_url

    url = make_url(db)
    backend, _, driver = url.drivername.partition("+")
    if backend == "sqlite" and driver in ("", "pysqlite"):
        return url.set(drivername="sqlite+aiosqlite")
    if backend == "postgresql" and driver in ("", "psycopg"):
        return url.set(drivername="postgresql+psycopg")
    if url.get_dialect().is_async:
        return url
    raise ValueError(f"no async driver for {url.drivername}: use postgresql+psycopg or sqlite")


def on_psycopg(conn: Connection) -> bool:
    """Whether a statement for ``conn`` may run on psycopg's own connection under it (in
    the transaction SQLAlchemy began there): the driver is psycopg and the connection maps
    no schemas (``schema_translate_map``: SQLAlchemy's compiler applies it, so those go
    through SQLAlchemy)."""
    return conn.dialect.driver == "psycopg" and not conn.get_execution_options().get(
        "schema_translate_map"
    )


def with_connection(url: str, fn: Callable[[Connection], R]) -> R:
    """Run ``fn(connection)`` on a fresh connection to ``url`` (async drivers too)."""
    import asyncio

    from sqlalchemy import create_engine, make_url, pool
    from sqlalchemy.ext.asyncio import create_async_engine

    if make_url(url).get_dialect().is_async:

        async def run() -> R:
            engine = create_async_engine(url, poolclass=pool.NullPool)
            try:
                async with engine.connect() as conn:
                    return await conn.run_sync(fn)
            finally:
                await engine.dispose()

        return asyncio.run(run())
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return fn(conn)
    finally:
        engine.dispose()


#: SQLite's and PostgreSQL's words for a missing table of txmq's
_TXMQ_TABLE_MISSING = re.compile(r'no such table: txmq_|relation "txmq_[a-z_]+" does not exist')


def describe_db_error(exc: SQLAlchemyError, url: str | URL) -> str:
    """One line for a database error: the URL (password hidden) and the driver's message,
    not the SQL statement."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError, DBAPIError

    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return f"not a database URL: {url!r} (expected e.g. postgresql+psycopg://user@host/db)"
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        detail = str(exc.orig).strip()
        if exc.connection_invalidated or "connect" in detail.lower():
            return f"cannot connect to {shown}: {detail}"
        if _TXMQ_TABLE_MISSING.search(detail):
            return (
                f"{shown} has no txmq tables yet ({detail.splitlines()[0]}): create them with "
                f"'txmq db upgrade --url {shown}'"
            )
        return f"database error on {shown}: {detail}"
    return f"{shown}: {str(exc).splitlines()[0]}"
