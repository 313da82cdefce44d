"""``txmq db``: create, upgrade and inspect txmq's tables in an application database."""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

from txmq.cli.options import SubParsers, add_command, non_negative_float
from txmq.observability.fmt import span
from txmq.sqla.db import describe_db_error, with_connection

# SQLAlchemy and alembic are imported when a db command runs, not with the CLI.

__all__ = ["add_parser", "run_db"]


def add_parser(sub: SubParsers) -> None:
    d = add_command(
        sub,
        "db",
        examples="  txmq db upgrade --url postgresql+psycopg://app@db/orders\n"
        "  txmq db current --url sqlite:///app.db\n"
        "  txmq db cleanup --url sqlite:///app.db --table consumed-keys --older-than-days 7",
        help="txmq's tables in your database (migrations, log retention)",
        description=(
            "Manage the tables txmq owns in an application database (the local-transaction "
            "log, ...). Migrations are alembic revisions with their own version table, "
            "txmq_alembic_version. URL is a SQLAlchemy URL, e.g. "
            "postgresql+psycopg://user@host/db or sqlite:///app.db."
        ),
    )
    dsub = d.add_subparsers(dest="db_cmd", required=True, metavar="COMMAND")
    up = add_command(
        dsub,
        "upgrade",
        help="create or upgrade txmq's tables",
        examples="  txmq db upgrade --url postgresql+psycopg://app@db/orders\n"
        "  txmq db upgrade --url sqlite:///app.db --revision 0004",
    )
    up.add_argument("--revision", default="head", help="target revision (default head)")
    down = add_command(
        dsub,
        "downgrade",
        help="downgrade txmq's tables ('base' drops them)",
        examples="  txmq db downgrade --url sqlite:///app.db --revision 0004\n"
        "  txmq db downgrade --url sqlite:///app.db --revision base   # drops txmq's tables",
    )
    down.add_argument("--revision", required=True, help="target revision, e.g. base")
    current = add_command(
        dsub,
        "current",
        help="the txmq revision the database is at",
        examples="  txmq db current --url postgresql+psycopg://app@db/orders",
    )
    clean = add_command(
        dsub,
        "cleanup",
        help="delete old rows of the transaction log",
        examples="  txmq db cleanup --url sqlite:///app.db --older-than-days 14\n"
        "  txmq db cleanup --url sqlite:///app.db --table consumed-keys --group billing",
    )
    clean.add_argument(
        "--older-than-days",
        type=non_negative_float,
        default=7.0,
        help="delete rows older than this (default 7); keep them longer than the broker "
        "may still check a half message",
    )
    clean.add_argument(
        "--table",
        choices=["transaction-log", "consumed-keys"],
        default="transaction-log",
        help="which table: the transaction log (default) or idempotent consumers' keys",
    )
    clean.add_argument("--group", help="consumed-keys: only this dedupe group")
    for p in (up, down, current, clean):
        p.add_argument("--url", required=True, help="SQLAlchemy database URL")
    d.set_defaults(func=run_db)


def run_db(args: argparse.Namespace) -> int:
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return _run(args)
    except SQLAlchemyError as exc:
        print(f"txmq: error: {describe_db_error(exc, args.url)}", file=sys.stderr)
    except CommandError as exc:
        print(f"txmq: error: {exc}", file=sys.stderr)
    except ModuleNotFoundError as exc:  # SQLAlchemy knows the dialect, its driver is missing
        print(
            f"txmq: error: no database driver for {args.url.split(':', 1)[0]!r} ({exc}); "
            "txmq's tables live in PostgreSQL (postgresql+psycopg://user@host/db) or SQLite "
            "(sqlite:///app.db)",
            file=sys.stderr,
        )
    return 1


def _run(args: argparse.Namespace) -> int:
    from alembic import command
    from sqlalchemy import make_url

    from txmq.sqla import migrate

    url: str = args.url
    make_url(url)  # a malformed URL fails here, with ArgumentError
    cmd = args.db_cmd
    if cmd in ("upgrade", "downgrade"):
        before = _current_text(url)
        run = command.upgrade if cmd == "upgrade" else command.downgrade
        run(migrate.alembic_config(url), args.revision)
        after = _current_text(url)
        if after == before:
            print(f"txmq tables already at {after}")
        else:
            print(f"txmq tables: {before} -> {after}")
    elif cmd == "current":
        text = _current_text(url)
        print(text if text != "base" else "base (no txmq tables: run 'txmq db upgrade --url URL')")
    elif cmd == "cleanup":
        from txmq.sqla.checker import cleanup_on

        age = timedelta(days=args.older_than_days)
        if args.table == "consumed-keys":
            from txmq.sqla.inbox import cleanup_consumed_keys

            deleted = with_connection(
                url, lambda conn: cleanup_consumed_keys(conn, age, group=args.group)
            )
            print(f"deleted {deleted} consumed key(s) older than {span(age)}")
            return 0
        deleted = with_connection(url, lambda conn: cleanup_on(conn, age, 10_000))
        print(f"deleted {deleted} transaction-log row(s) older than {span(age)}")
    else:  # pragma: no cover - argparse rejects it
        raise SystemExit(f"unknown db command {cmd}")
    return 0


def _current_text(url: str) -> str:
    from alembic.script import ScriptDirectory

    from txmq.sqla import migrate

    heads = with_connection(url, migrate.current)
    if not heads:
        return "base"
    head = ScriptDirectory.from_config(migrate.alembic_config()).get_current_head()
    return ", ".join(f"{rev} (head)" if rev == head else rev for rev in heads)
