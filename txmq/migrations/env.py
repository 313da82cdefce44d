"""Alembic environment for txmq's tables (own version table: ``txmq_alembic_version``).

The database comes from ``config.attributes["connection"]`` (a SQLAlchemy Connection),
else ``-x url=...``, else the ``sqlalchemy.url`` option. Async driver URLs
(``postgresql+psycopg`` async, ``sqlite+aiosqlite``) work too.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import Connection, create_engine, make_url, pool
from sqlalchemy.ext.asyncio import create_async_engine

from txmq.sqla.migrate import configure_options

config = context.config


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database URL: pass -x url=... or set sqlalchemy.url")
    return url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        render_as_batch=connection.dialect.name == "sqlite",
        **configure_options(),
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async(url: str) -> None:
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
    finally:
        await engine.dispose()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = _url()
    if make_url(url).get_dialect().is_async:
        asyncio.run(_run_async(url))
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


def run_offline() -> None:
    context.configure(url=_url(), literal_binds=True, **configure_options())
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
