"""``txmq outbox``: run a relay, and look after the outbox table."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from datetime import timedelta
from typing import Any

from txmq.cli.options import (
    SubParsers,
    add_command,
    add_endpoints,
    endpoints,
    non_negative_float,
    share,
)
from txmq.cli.tables import table
from txmq.observability.fmt import span
from txmq.sqla.db import describe_db_error, with_connection

__all__ = ["add_parser", "run_outbox"]

log = logging.getLogger("txmq.outbox")

#: the commands that print rows (and take --json)
ROW_COMMANDS = ("stats", "parked")


def _db(parser: argparse.ArgumentParser, default: object) -> None:
    """``--db``: every outbox command's database (a :data:`~txmq.cli.options.Shared`)."""
    parser.add_argument(
        "--db", "--url", dest="db", default=default, help="SQLAlchemy database URL (required)"
    )


def _json(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        default=default if default is argparse.SUPPRESS else False,
        help="print JSON",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        default=default if default is argparse.SUPPRESS else False,
        help="every column of a table, however wide (tables fit $COLUMNS or the terminal)",
    )


def add_parser(sub: SubParsers) -> None:
    o = add_command(
        sub,
        "outbox",
        examples="  txmq outbox relay --db postgresql+psycopg://app@db/orders --broker HOST:PORT\n"
        "  txmq outbox relay --db sqlite:///app.db --namesrv 'ns1:9876;ns2:9876'\n"
        "  txmq outbox stats --db sqlite:///app.db --json\n"
        "  txmq outbox requeue --db sqlite:///app.db --all",
        help="the transactional outbox: relay it to the broker, inspect it",
        description=(
            "Messages added with outbox.add() wait in the txmq_outbox table of your database "
            "until a relay sends them to the broker. DB is a SQLAlchemy URL, e.g. "
            "postgresql+psycopg://user@host/db or sqlite:///app.db."
        ),
    )
    osub = o.add_subparsers(dest="outbox_cmd", required=True, metavar="COMMAND")
    r = add_command(
        osub,
        "relay",
        help="send outbox rows to the broker until stopped (SIGTERM/SIGINT)",
        description=(
            "Sends outbox rows at least once, in order per sharding key. Several relays may\n"
            "run at once (each key is worked on by one relay at a time); SQLite needs one.\n"
            "Wakes on LISTEN/NOTIFY on PostgreSQL, polls on SQLite. Sends to one broker\n"
            "(--broker) or over a cluster through its name servers (--namesrv)."
        ),
        examples="  txmq outbox relay --db postgresql+psycopg://app@db/orders --broker HOST:PORT\n"
        "  txmq outbox relay --db sqlite:///app.db --namesrv 'ns1:9876;ns2:9876' "
        "--stats-interval 60",
    )
    r.add_argument("--batch-size", type=int, default=500, help="rows per cycle (default 500)")
    r.add_argument(
        "--cycles-in-flight",
        type=int,
        default=2,
        help="cycles sending at once on PostgreSQL: the next claim starts while earlier "
        "rows are sent (default 2; SQLite runs one)",
    )
    r.add_argument(
        "--max-attempts", type=int, default=10, help="failed sends before a row is parked"
    )
    r.add_argument("--backoff", type=float, default=0.5, help="first retry delay, seconds")
    r.add_argument(
        "--poll-interval", type=float, help="seconds between polls (1 with LISTEN, 0.1 SQLite)"
    )
    r.add_argument("--no-listen", action="store_true", help="poll only, even on PostgreSQL")
    r.add_argument(
        "--retention-hours",
        type=non_negative_float,
        default=24.0,
        help="delete sent rows this long after sending (default 24; 0 deletes them at once)",
    )
    r.add_argument(
        "--claim-lease",
        type=float,
        default=30.0,
        help="SQLite: seconds a cycle's rows stay claimed while sent (default 30)",
    )
    r.add_argument(
        "--stats-interval", type=float, default=10.0, help="print stats every N s (0: never)"
    )
    st = add_command(
        osub,
        "stats",
        help="backlog, lag, parked and sent rows",
        examples="  txmq outbox stats --db sqlite:///app.db\n"
        "  txmq outbox stats --db postgresql+psycopg://app@db/orders --json",
    )
    pk = add_command(
        osub,
        "parked",
        help="rows parked after their last failed attempt",
        examples="  txmq outbox parked --db sqlite:///app.db --max 20",
    )
    pk.add_argument("--max", type=int, default=100, help="most rows to show")
    rq = add_command(
        osub,
        "requeue",
        help="send parked rows again",
        examples="  txmq outbox requeue --db sqlite:///app.db --id 17 --id 18\n"
        "  txmq outbox requeue --db sqlite:///app.db --all",
    )
    which = rq.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", type=int, action="append", help="row id (repeat for several)")
    which.add_argument("--all", action="store_true", help="every parked row")
    cl = add_command(
        osub,
        "cleanup",
        help="delete sent rows (the relay does it as well)",
        examples="  txmq outbox cleanup --db sqlite:///app.db --older-than-hours 48",
    )
    cl.add_argument(
        "--older-than-hours",
        type=non_negative_float,
        default=24.0,
        help="delete rows sent longer ago than this (default 24)",
    )
    # every option is accepted before or after the subcommand: --db (all of them), --json
    # (the commands that print rows), where the relay sends (the other commands only touch
    # the database)
    share(o, _db)
    _json(o, None)
    for p in (st, pk):
        _json(p, argparse.SUPPRESS)
    add_endpoints(o, None)
    add_endpoints(r, argparse.SUPPRESS)
    o.set_defaults(func=run_outbox)


def run_outbox(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from txmq.outbox.relay import OutboxNotReady

    cmd = args.outbox_cmd
    if not args.db:
        return _usage_error(cmd, "the following arguments are required: --db/--url")
    if args.json and cmd not in ROW_COMMANDS:
        return _usage_error(cmd, f"--json is for {' and '.join(ROW_COMMANDS)}, not {cmd}")
    try:
        if cmd == "relay":
            return _relay(args)
        return _table_command(args)
    except (SQLAlchemyError, ArgumentError) as exc:
        print(f"txmq: error: {describe_db_error(exc, args.db)}", file=sys.stderr)
    except OutboxNotReady as exc:
        print(f"txmq: error: {exc}", file=sys.stderr)
    return 1


def _usage_error(cmd: str, message: str) -> int:
    """What argparse says of a bad command line (its exit code, 2)."""
    print(f"txmq outbox {cmd}: error: {message}", file=sys.stderr)
    return 2


def _table_command(args: argparse.Namespace) -> int:
    from txmq import outbox

    cmd = args.outbox_cmd
    if cmd == "stats":
        s = with_connection(args.db, outbox.stats)
        if args.json:
            print(json.dumps(s.as_dict()))
        else:
            print(table([s.as_dict()], wide=args.wide))
    elif cmd == "parked":
        rows = with_connection(args.db, lambda conn: outbox.parked(conn, limit=args.max))
        if args.json:
            print(json.dumps(rows, default=str, indent=2))
        else:
            print(table(rows, wide=args.wide))
    elif cmd == "requeue":
        n = with_connection(
            args.db, lambda conn: outbox.requeue(conn, None if args.all else args.id)
        )
        print(f"requeued {n} parked row(s)")
    elif cmd == "cleanup":
        age = timedelta(hours=args.older_than_hours)
        n = with_connection(args.db, lambda conn: outbox.cleanup(conn, age))
        print(f"deleted {n} sent outbox row(s) older than {span(age)}")
    else:  # pragma: no cover - argparse rejects it
        raise SystemExit(f"unknown outbox command {cmd}")
    return 0


def _relay(args: argparse.Namespace) -> int:
    import anyio

    from txmq.client.producer import Producer
    from txmq.outbox.relay import OutboxRelay

    where = endpoints(args)
    # through name servers the relay is given its producer (OutboxRelay takes an address)
    producer = (
        Producer(namesrv=where["namesrv"], group="txmq-outbox-relay") if where["namesrv"] else None
    )
    relay = OutboxRelay(
        args.db,
        producer or where["address"],
        batch_size=args.batch_size,
        cycles_in_flight=args.cycles_in_flight,
        max_attempts=args.max_attempts,
        backoff=args.backoff,
        poll_interval=args.poll_interval,
        listen=not args.no_listen,
        retention=timedelta(hours=args.retention_hours),
        claim_lease=args.claim_lease,
    )

    async def run() -> None:
        if producer is not None:
            await producer.start()
        try:
            await relay_until_stopped()
        finally:
            if producer is not None:
                await producer.stop()

    async def relay_until_stopped() -> None:
        async with relay, anyio.create_task_group() as tg:
            # listening for the signals before saying it runs: a Ctrl-C from then on stops it
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                how = (
                    "LISTEN/NOTIFY" if relay.listen else f"polling every {relay.poll_interval:g} s"
                )
                target = relay.producer.address
                if relay.producer.direct is None:
                    target = f"name servers {target}"
                print(f"txmq outbox relay: {relay.shown_url} -> {target} ({how})", flush=True)
                if args.stats_interval > 0:
                    tg.start_soon(_print_stats, relay, args.stats_interval)
                async for signum in signals:
                    log.info("received %s; stopping the relay", signal.Signals(signum).name)
                    break
            tg.cancel_scope.cancel()
        print(f"txmq outbox relay stopped; sent {relay.sent_total} row(s)", flush=True)

    anyio.run(run)
    return 0


async def _print_stats(relay: Any, interval: float) -> None:
    import anyio

    last_sent, last_time = relay.sent_total, time.monotonic()
    while True:
        await anyio.sleep(interval)
        try:
            s = await relay.stats()
        except Exception as exc:
            log.warning("outbox stats failed: %s", exc)
            continue
        now = time.monotonic()
        rate = (relay.sent_total - last_sent) / max(now - last_time, 1e-9)
        last_sent, last_time = relay.sent_total, now
        print(
            f"outbox: sent {relay.sent_total} ({rate:.0f}/s), backlog {s.backlog}, "
            f"lag {s.lag_seconds:.3f} s, parked {s.parked}",
            flush=True,
        )
