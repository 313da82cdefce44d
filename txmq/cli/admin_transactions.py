"""``txmq admin transactions``: list undecided, parked and operator-decided half messages,
and finish a transaction as an operator (commit / rollback with a reason, recheck a parked
one)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

import msgspec

from txmq.cli.options import CommandError, SubParsers, add_command, endpoints
from txmq.cli.tables import table
from txmq.observability.fmt import ms_time, with_times

if TYPE_CHECKING:
    from txmq.admin.client import BrokerDecisionRow

__all__ = ["add_transactions", "decision_table", "run_decide"]

BROKER_NAME_HELP = "only the broker set with this name (with --namesrv)"


def add_transactions(asub: SubParsers, shared: Any) -> argparse.ArgumentParser:
    """``txmq admin transactions [--pending | --parked | --decided]`` and its commands
    ``commit``, ``rollback``, ``recheck``; ``shared`` adds the options every admin command
    takes (the listing parser has commands of its own, so it gets them here)."""
    tx = add_command(
        asub,
        "transactions",
        help="undecided, parked and operator-decided transactional (half) messages",
        description=(
            "List half messages whose producer has not committed or rolled them back yet\n"
            "(--pending), that stayed undecided through every check-back and were parked for\n"
            "an operator (--parked), or what operators decided (--decided). Or finish one:\n"
            "commit / rollback (with a reason, recorded by the broker and listed by\n"
            "--decided), or recheck a parked one (its producer group is asked again, from\n"
            "the first check)."
        ),
        examples="  txmq admin transactions --parked\n"
        "  txmq admin transactions commit --id 7F0000010A2B... --reason 'order 42 was paid'\n"
        "  txmq admin transactions rollback --id 7F0000010A2B... --reason 'payment failed'\n"
        "  txmq admin transactions recheck --all --group orders-tx\n"
        "  txmq admin transactions --decided --json",
    )
    which = tx.add_mutually_exclusive_group()
    which.add_argument("--pending", action="store_true", help="waiting for a decision")
    which.add_argument("--parked", action="store_true", help="parked after the last check")
    which.add_argument("--decided", action="store_true", help="decided by an operator")
    tx.add_argument("--group", help="only this producer group")
    tx.add_argument("--max", type=int, default=100, help="most transactions to show")
    tx.add_argument("--broker-name", help=BROKER_NAME_HELP)
    shared(tx, argparse.SUPPRESS)
    tsub = tx.add_subparsers(dest="tx_cmd", metavar="COMMAND")
    for name, does in (
        ("commit", "deliver the half message's real message to its consumers"),
        ("rollback", "drop the half message: its consumers never see it"),
    ):
        c = add_command(
            tsub,
            name,
            help=f"{name} a pending or parked half message: {does}",
            description=(
                f"{name.upper()} a half message as an operator, whether its producer has not\n"
                "decided yet (pending) or it was parked after the last check-back. The\n"
                "reason is recorded by the broker with who decided (--operator, else\n"
                "user@host) and listed by 'transactions --decided'. A half its producer\n"
                "already decided is refused."
            ),
            examples=f"  txmq admin transactions {name} --id 7F0000010A2B... --reason 'ticket 7'",
        )
        c.add_argument("--id", required=True, help="the half message's id (msg_id)")
        c.add_argument("--reason", required=True, help="why (recorded with the decision)")
        _decision_options(c)
    r = add_command(
        tsub,
        "recheck",
        help="ask a parked half message's producer group again, from the first check",
        description=(
            "Take parked half messages back: each is checked back with its producer group\n"
            "again, from the next check round, as many times as at first, and parked again\n"
            "if it stays undecided."
        ),
        examples="  txmq admin transactions recheck --id 7F0000010A2B...\n"
        "  txmq admin transactions recheck --all --group orders-tx",
    )
    one = r.add_mutually_exclusive_group(required=True)
    one.add_argument("--id", help="the parked half message's id (msg_id)")
    one.add_argument("--all", action="store_true", help="every parked half message")
    r.add_argument("--group", help="only this producer group")
    r.add_argument("--reason", default="", help="why (recorded with the decision)")
    _decision_options(r)
    return tx


def _decision_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--operator", help="who decides (default: user@host)")
    parser.add_argument("--broker-name", help=BROKER_NAME_HELP)


def run_decide(args: argparse.Namespace) -> int:
    """``commit``, ``rollback`` or ``recheck``."""
    import anyio

    from txmq.admin.client import AdminClient

    where = endpoints(args)
    decision = args.tx_cmd.upper()
    every = bool(getattr(args, "all", False))
    if every and decision != "RECHECK":
        raise CommandError("--all is for recheck only")

    async def run() -> list[BrokerDecisionRow]:
        async with AdminClient(where["address"], namesrv=where["namesrv"]) as admin:
            return await admin.decide_transaction(
                decision,
                msg_id=args.id,
                all=every,
                group=getattr(args, "group", None),
                reason=args.reason,
                operator=args.operator,
                broker=args.broker_name,
            )

    rows = anyio.run(run)
    if args.json:
        print(json.dumps([with_times(r) for r in decision_table(rows, raw=True)], indent=2))
    elif not rows:
        print("no parked half message to re-check")
    else:
        drop = ["transaction_id", "was", "new_offset", "operator", "topic", "decided"]
        print(table(decision_table(rows), drop=drop, wide=args.wide))
    return 0


def decision_table(rows: list[BrokerDecisionRow], *, raw: bool = False) -> list[dict[str, Any]]:
    """Decisions as table rows (``raw``: every field, for JSON)."""
    out: list[dict[str, Any]] = []
    for r in rows:
        row: dict[str, Any] = msgspec.structs.asdict(r)
        name = row.pop("broker_name")
        if not raw:
            row = {
                "decided": ms_time(r.decided_timestamp),
                "decision": r.decision,
                "msg_id": r.msg_id,
                "transaction_id": r.transaction_id,
                "group": r.group,
                "topic": r.topic,
                "was": r.was,
                "operator": r.operator,
                "reason": r.reason,
                **({"new_offset": r.recheck_offset} if r.recheck_offset is not None else {}),
            }
        out.append({"broker_name": name, **row} if name else row)
    return out
