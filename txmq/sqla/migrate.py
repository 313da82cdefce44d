"""Migrations of txmq's own tables (the alembic environment in the ``migrations`` package).

txmq keeps its revisions in its own script directory and its own version table,
``txmq_alembic_version``, so it never clashes with an application's alembic. Either run
``txmq db upgrade --url URL``, or call :func:`upgrade` from your alembic ``env.py``::

    with connectable.connect() as connection:
        txmq.sqla.upgrade(connection)          # txmq's tables, committed
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            include_name=txmq.sqla.include_name,  # autogenerate leaves txmq_* tables alone
        )
        with context.begin_transaction():
            context.run_migrations()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import op as _op_module
from alembic.config import Config
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

from txmq.sqla.tables import TABLE_PREFIX, metadata

__all__ = [
    "VERSION_TABLE",
    "alembic_config",
    "configure_options",
    "current",
    "downgrade",
    "include_name",
    "script_location",
    "upgrade",
]

VERSION_TABLE = "txmq_alembic_version"


def script_location() -> Path:
    """The installed ``migrations`` package: alembic's script directory for txmq."""
    return Path(str(resources.files("txmq.migrations")))


def alembic_config(url: str | None = None, connection: Connection | None = None) -> Config:
    """An alembic :class:`Config` for txmq's migrations, built in code (no ini file needed).

    ``url`` or ``connection`` names the database; ``env.py`` uses the connection if given.
    """
    location = script_location()
    cfg = Config(str(location / "alembic.ini"))
    cfg.set_main_option("script_location", str(location))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def configure_options() -> dict[str, Any]:
    """The options txmq's migrations always run with (``context.configure(**these)``)."""
    return {"target_metadata": metadata, "version_table": VERSION_TABLE}


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """An ``include_name`` hook for *your* alembic autogenerate: skip txmq's tables.

    ``context.configure(..., include_name=txmq.sqla.include_name)``; chain it with your
    own hook if you have one.
    """
    return not (type_ == "table" and name is not None and name.startswith(TABLE_PREFIX))


def upgrade(connection: Connection, revision: str = "head") -> None:
    """Upgrade txmq's tables to ``revision`` on ``connection``.

    Runs in its own transaction, committed, unless ``connection`` is already in one (then
    the caller commits). Safe to call from an alembic ``env.py``, before
    ``context.run_migrations()``.
    """
    script = ScriptDirectory.from_config(alembic_config())
    _run(connection, script, lambda rev, _ctx: script._upgrade_revs(revision, rev))


def downgrade(connection: Connection, revision: str) -> None:
    """Downgrade txmq's tables to ``revision`` (``"base"`` drops them all)."""
    script = ScriptDirectory.from_config(alembic_config())
    _run(connection, script, lambda rev, _ctx: script._downgrade_revs(revision, rev))


def current(connection: Connection) -> tuple[str, ...]:
    """The txmq revision(s) the database is at; ``()`` before the first upgrade."""
    return MigrationContext.configure(connection, opts=configure_options()).get_current_heads()


def _run(connection: Connection, script: ScriptDirectory, fn: Any) -> None:
    opts = {**configure_options(), "fn": fn, "script": script}
    if connection.dialect.name == "sqlite":
        opts["render_as_batch"] = True
    ctx = MigrationContext.configure(connection, opts=opts)
    with _operations(ctx), ctx.begin_transaction():
        ctx.run_migrations()


@contextmanager
def _operations(ctx: MigrationContext) -> Iterator[None]:
    """Install alembic's ``op`` proxy for our revisions, and put back whatever ``op`` was
    before (alembic itself would just remove it)."""
    previous = getattr(_op_module, "_proxy", None)
    with Operations.context(ctx):
        yield
    if previous is not None:
        previous._install_proxy()
