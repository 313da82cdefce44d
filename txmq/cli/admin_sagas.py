"""``txmq admin sagas``: the sagas a coordinating service keeps in its database — list them,
show one with its step log, and, for a parked one, retry its failing operation or record
that it was done by hand (``resolve``) so the saga goes on."""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

from txmq.cli.options import CommandError, SubParsers, add_command, endpoints, positive_int
from txmq.cli.tables import table
from txmq.observability.fmt import span
from txmq.saga.model import OPERATOR_GROUP, State

__all__ = ["add_sagas", "run_sagas"]


def add_sagas(asub: SubParsers) -> None:
    s = add_command(
        asub,
        "sagas",
        help="sagas in a coordinating service's database: list, show, retry, resolve",
        description=(
            "A saga's state lives in the database of the service that started it (--db).\n"
            "list and show read it; retry and resolve act on a PARKED saga (a compensation\n"
            "or confirm out of retries): retry sends the operation again, resolve records\n"
            "that it was done by hand and lets the saga go on. Both record who (--operator)\n"
            "and why (--reason) in the saga's step log, and send their command through the\n"
            "broker (--broker or --namesrv) as a transactional message."
        ),
        examples="  txmq admin sagas list --db postgresql+psycopg://app@db/orders --state PARKED\n"
        "  txmq admin sagas show 3f2a... --db sqlite:///orders.db\n"
        "  txmq admin sagas retry 3f2a... --reason 'bank is back' --db sqlite:///orders.db\n"
        "  txmq admin sagas resolve 3f2a... --reason 'refunded by hand, ticket 7' --db ...",
    )
    ssub = s.add_subparsers(dest="sagas_cmd", required=True, metavar="COMMAND")
    ls = add_command(
        ssub,
        "list",
        help="sagas, most recently changed first",
        examples="  txmq admin sagas list --db sqlite:///orders.db\n"
        "  txmq admin sagas list --db postgresql+psycopg://app@db/orders --state PARKED --json",
    )
    ls.add_argument("--state", choices=State.ALL, help="only sagas in this state")
    ls.add_argument("--max", type=positive_int, default=50, help="most sagas to show (default 50)")
    show = add_command(
        ssub,
        "show",
        help="one saga with its step log",
        examples="  txmq admin sagas show 3f2a... --db sqlite:///orders.db",
    )
    show.add_argument("saga_id")
    leaves = [ls, show]
    for name, does, example in (
        (
            "retry",
            "send a parked saga's failing compensation or confirm again",
            "3f2a... --reason 'bank is back' --db sqlite:///orders.db",
        ),
        (
            "resolve",
            "record that a parked saga's failing operation was done by hand",
            "3f2a... --reason 'refunded by hand, ticket 7' --operator alice --db ...",
        ),
    ):
        c = add_command(ssub, name, help=does, examples=f"  txmq admin sagas {name} {example}")
        leaves.append(c)
        c.add_argument("saga_id")
        c.add_argument("--reason", required=True, help="why (recorded in the step log)")
        c.add_argument("--operator", help="who (default: user@host)")
        c.add_argument(
            "--group",
            default=OPERATOR_GROUP,
            help="the producer group of the command's transaction (default "
            "txmq-saga-operator; the coordinating service's own group lets it answer the "
            "check-back should this command be cut off)",
        )
    for leaf in leaves:
        leaf.add_argument("--db", "--url", dest="db", required=True, help="SQLAlchemy URL")


def _age(at: datetime) -> str:
    """How long ago ``at`` was (SQLite's timestamps are naive UTC)."""
    aware = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    return span(datetime.now(UTC) - aware)


def _steps(info: Any) -> list[dict[str, Any]]:
    return [
        {
            "step": e.step,
            "branch": e.branch,
            "op": e.op,
            "event": e.event,
            "attempts": e.attempts,
            "at": e.at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            "detail": e.detail or "",
        }
        for e in info.steps
    ]


def run_sagas(args: argparse.Namespace) -> int:
    from sqlalchemy import create_engine
    from sqlalchemy.exc import SQLAlchemyError

    from txmq.saga import list_sagas, saga_info
    from txmq.sqla.db import describe_db_error

    engine = create_engine(args.db)
    try:
        if args.sagas_cmd == "list":
            with engine.connect() as conn:
                found = list_sagas(conn, state=args.state, limit=args.max)
            if args.json:
                print(json.dumps([dataclasses.asdict(i) for i in found], indent=2, default=str))
                return 0
            rows = [
                {
                    "saga_id": i.saga_id,
                    "name": i.name,
                    "state": i.state,
                    "step": i.step,
                    "age": _age(i.created_at),
                    "error": (i.error or "")[:60],
                }
                for i in found
            ]
            print(table(rows, drop=["age"], wide=args.wide))
            return 0
        if args.sagas_cmd != "show":  # retry, resolve: operate() looks the saga up itself
            return _operate(args)
        with engine.connect() as conn:
            info = saga_info(conn, args.saga_id)
        if info is None:
            raise CommandError(f"no saga {args.saga_id} in {engine.url.render_as_string()}")
        if args.json:
            print(json.dumps(dataclasses.asdict(info), indent=2, default=str))
            return 0
        print(f"saga {info.saga_id} ({info.name}): {info.state} at step {info.step}")
        if info.error:
            print(f"error: {info.error}")
        print(f"data: {json.dumps(info.data, default=str)}")
        print(table(_steps(info), wide=args.wide))
        return 0
    except SQLAlchemyError as exc:
        raise CommandError(describe_db_error(exc, args.db)) from exc
    finally:
        engine.dispose()


def _operate(args: argparse.Namespace) -> int:
    import anyio

    from txmq.admin.transactions import operator_name
    from txmq.saga.operate import operate

    where = endpoints(args)
    operator = args.operator or operator_name()

    async def run() -> str:
        return await operate(
            args.db,
            args.saga_id,
            args.sagas_cmd,
            operator=operator,
            reason=args.reason,
            group=args.group,
            address=where["address"],
            namesrv=where["namesrv"],
        )

    try:
        state = anyio.run(run)
    except (LookupError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    done = f"{args.sagas_cmd} recorded ({operator}: {args.reason})"
    print(f"saga {args.saga_id}: {done}; now {state}")
    return 0
