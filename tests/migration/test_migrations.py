"""txmq's alembic revisions build exactly ``txmq.sqla.metadata`` on an empty database
(a fresh PostgreSQL database and a SQLite file), and downgrade to nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, create_engine, inspect, make_url, text
from sqlalchemy.exc import OperationalError

from tests.conftest import ROOT
from tests.sqla_support import PG_URL, pg_unreachable
from txmq.sqla import VERSION_TABLE, alembic_config, current, downgrade, metadata, upgrade

TXMQ_TABLES = set(metadata.tables)
HEAD = "0005"  # the newest txmq revision


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    """A new, empty PostgreSQL database, dropped afterwards."""
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"txmq_mig_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        pg_unreachable(exc)
    try:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.db'}"
    else:
        yield request.getfixturevalue("fresh_pg_url")


def schema_diffs(conn: Connection) -> list[Any]:
    """Differences between the database's txmq tables and txmq.sqla.metadata."""

    def only_txmq(name: str | None, type_: str, parent_names: Any) -> bool:
        return type_ != "table" or name in TXMQ_TABLES

    opts = {"version_table": VERSION_TABLE, "compare_type": True, "include_name": only_txmq}
    ctx = MigrationContext.configure(conn, opts=opts)
    return list(compare_metadata(ctx, metadata))


def describe(conn: Connection) -> dict[str, Any]:
    """Tables, columns (name, nullable), primary keys and indexes, as the database has them."""
    insp = inspect(conn)
    out: dict[str, Any] = {}
    for table in sorted(set(insp.get_table_names()) - {VERSION_TABLE}):
        out[table] = {
            "columns": [(c["name"], c["nullable"]) for c in insp.get_columns(table)],
            "pk": insp.get_pk_constraint(table)["constrained_columns"],
            "indexes": sorted(
                (i["name"], tuple(i["column_names"])) for i in insp.get_indexes(table)
            ),
        }
    return out


def declared() -> dict[str, Any]:
    """The same description, from txmq.sqla.metadata."""
    return {
        t.name: {
            "columns": [(c.name, c.nullable) for c in t.columns],
            "pk": [c.name for c in t.primary_key.columns],
            "indexes": sorted((i.name, tuple(c.name for c in i.columns)) for i in t.indexes),
        }
        for t in sorted(metadata.tables.values(), key=lambda t: t.name)
    }


def test_upgrade_builds_exactly_the_metadata_then_downgrade_removes_it(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            assert inspect(conn).get_table_names() == []
        command.upgrade(alembic_config(empty_db_url), "head")
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) == TXMQ_TABLES | {VERSION_TABLE}
            assert schema_diffs(conn) == []
            assert describe(conn) == declared()
            assert current(conn) == (HEAD,)
            assert "alembic_version" not in inspect(conn).get_table_names()  # never the app's
        command.downgrade(alembic_config(empty_db_url), "base")
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) <= {VERSION_TABLE}
            assert current(conn) == ()
        command.upgrade(alembic_config(empty_db_url), "head")  # and back up again
        with engine.connect() as conn:
            assert schema_diffs(conn) == []
    finally:
        engine.dispose()


def _barrier_answers(conn: Connection) -> bool | None:
    """Whether txmq_saga_barrier has its answer column (None: there is no such table)."""
    if "txmq_saga_barrier" not in inspect(conn).get_table_names():
        return None
    return "answer" in {c["name"] for c in inspect(conn).get_columns("txmq_saga_barrier")}


def test_revisions_one_step_at_a_time(empty_db_url: str) -> None:
    """0001 -> 0002 (outbox) -> 0003 (consumed keys) -> 0004 (sagas) -> 0005 (the
    barrier's answers) and back, each step on its own; the transaction log keeps its rows
    throughout."""
    engine = create_engine(empty_db_url)
    steps = [("0001", {"txmq_transaction_log"}), ("0002", {"txmq_outbox"})]
    steps.append(("0003", {"txmq_consumed_keys"}))
    steps.append(("0004", {"txmq_sagas", "txmq_saga_steps", "txmq_saga_barrier"}))
    steps.append(("0005", set()))  # txmq_saga_barrier.answer
    try:
        with engine.connect() as conn:
            upgrade(conn, "0001")
            conn.execute(
                text(
                    "INSERT INTO txmq_transaction_log (transaction_id, producer_group, state) "
                    "VALUES ('t1', 'g', 'COMMITTED')"
                )
            )
            conn.commit()
        seen: set[str] = set()
        for rev, tables in steps:
            with engine.connect() as conn:
                upgrade(conn, rev)
            with engine.connect() as conn:
                seen |= tables
                assert current(conn) == (rev,)
                assert set(inspect(conn).get_table_names()) - {VERSION_TABLE} == seen
                assert _barrier_answers(conn) == (None if rev < "0004" else rev >= "0005")
        for rev, tables in reversed(steps[1:]):
            with engine.connect() as conn:
                downgrade(conn, str(int(rev) - 1).zfill(4))
                conn.commit()
            with engine.connect() as conn:
                seen -= tables
                assert set(inspect(conn).get_table_names()) - {VERSION_TABLE} == seen
                assert _barrier_answers(conn) == (None if rev <= "0004" else False)
        with engine.connect() as conn:
            assert current(conn) == ("0001",)
            count = conn.execute(text("SELECT count(*) FROM txmq_transaction_log")).scalar()
            assert count == 1
    finally:
        engine.dispose()


def test_programmatic_upgrade_on_a_connection(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            upgrade(conn)  # commits on its own
        with engine.connect() as conn:
            assert schema_diffs(conn) == [] and current(conn) == (HEAD,)
            # the connection is in a transaction now (those reads): the caller commits
            upgrade(conn)  # already at head: nothing to do
            downgrade(conn, "base")
            conn.commit()
        with engine.connect() as conn:
            assert not TXMQ_TABLES & set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


USER_ENV = """
from alembic import context
from sqlalchemy import create_engine, pool

import txmq.sqla
from app_models import metadata as target_metadata

config = context.config
engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
with engine.connect() as connection:
    txmq.sqla.upgrade(connection)
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_name=txmq.sqla.include_name,
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

USER_MODELS = """
from sqlalchemy import Column, Integer, MetaData, String, Table

metadata = MetaData()
orders = Table("orders", metadata, Column("id", String(64), primary_key=True),
               Column("amount", Integer, nullable=False))
"""

USER_REVISION = '''
"""orders"""
import sqlalchemy as sa
from alembic import op

revision = "a1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("orders", sa.Column("id", sa.String(64), primary_key=True),
                    sa.Column("amount", sa.Integer, nullable=False))


def downgrade():
    op.drop_table("orders")
'''


def test_inside_an_applications_own_alembic(
    empty_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented recipe: the app's env.py calls txmq.sqla.upgrade(connection) and
    filters txmq's tables out of its autogenerate; both version tables stay apart."""
    app = tmp_path / "app_migrations"
    (app / "versions").mkdir(parents=True)
    (app / "env.py").write_text(USER_ENV)
    (app / "versions" / "a1_orders.py").write_text(textwrap.dedent(USER_REVISION))
    (tmp_path / "app_models.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = Config()
    cfg.set_main_option("script_location", str(app))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("sqlalchemy.url", empty_db_url)

    command.upgrade(cfg, "head")
    command.check(cfg)  # the app's autogenerate sees no difference: txmq tables ignored
    engine = create_engine(empty_db_url)
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            assert tables == {"orders", "alembic_version", VERSION_TABLE} | TXMQ_TABLES
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "a1"
            assert current(conn) == (HEAD,)
            assert schema_diffs(conn) == []
    finally:
        engine.dispose()


def txmq_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "txmq.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_cli_upgrade_current_downgrade(empty_db_url: str) -> None:
    r = txmq_cli("db", "current", "--url", empty_db_url)
    assert r.returncode == 0 and r.stdout.startswith("base"), r
    r = txmq_cli("db", "upgrade", "--url", empty_db_url)
    assert r.returncode == 0, r.stderr
    assert f"base -> {HEAD} (head)" in r.stdout
    assert txmq_cli("db", "current", "--url", empty_db_url).stdout.strip() == f"{HEAD} (head)"
    assert f"already at {HEAD}" in txmq_cli("db", "upgrade", "--url", empty_db_url).stdout
    engine = create_engine(empty_db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO txmq_transaction_log (transaction_id, producer_group, state, "
                "created_at) VALUES ('old', 'g', 'COMMITTED', '2000-01-01 00:00:00'), "
                "('new', 'g', 'COMMITTED', CURRENT_TIMESTAMP)"
            )
        )
    engine.dispose()
    r = txmq_cli("db", "cleanup", "--url", empty_db_url, "--older-than-days", "1")
    assert r.returncode == 0 and "deleted 1 " in r.stdout, r.stderr
    r = txmq_cli("db", "downgrade", "--url", empty_db_url, "--revision", "base")
    assert r.returncode == 0 and f"{HEAD} (head) -> base" in r.stdout, r.stderr


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg://postgres:secret@127.0.0.1:1/nowhere", "cannot connect to"),
        ("sqlite:////nonexistent/dir/app.db", "unable to open database file"),
        ("not a url", "not a database URL"),
    ],
)
def test_cli_bad_database_is_a_clear_error(url: str, expected: str) -> None:
    r = txmq_cli("db", "upgrade", "--url", url)
    assert r.returncode == 1
    assert expected in r.stderr
    assert "Traceback" not in r.stderr and "secret" not in r.stderr
    assert r.stderr.startswith("txmq: error:")


def test_cli_unknown_revision(tmp_path: Path) -> None:
    r = txmq_cli("db", "downgrade", "--url", f"sqlite:///{tmp_path / 'a.db'}", "--revision", "zz")
    assert r.returncode == 1 and "zz" in r.stderr and "Traceback" not in r.stderr


def test_upgrade_puts_back_the_callers_op(tmp_path: Path) -> None:
    """Called while the application's own migration runs, upgrade() leaves alembic's
    ``op`` proxy as it found it."""
    import alembic.op
    from alembic.operations import Operations

    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    try:
        with engine.connect() as conn:
            with Operations.context(MigrationContext.configure(conn)) as outer:
                upgrade(conn)
                assert alembic.op._proxy is outer
            conn.commit()
            assert current(conn) == (HEAD,)
    finally:
        engine.dispose()
