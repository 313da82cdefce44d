"""``txmq admin group``: consumer-group configs (RocketMQ's SubscriptionGroupConfig) —
whether a group is FIFO (the broker delivers a queue's messages one batch at a time, in
order) and its retry limit (``retry_max_times``, 16 by default) — set, listed and deleted
on one broker or on every master of a cluster."""

from __future__ import annotations

import argparse
import json
from typing import Any

import anyio
import msgspec

from txmq.admin import AdminClient
from txmq.cli.options import CommandError, SubParsers, add_command, endpoints
from txmq.fmt import format_table
from txmq.wire import GroupConfigRow

__all__ = ["add_group", "run_group"]

BROKER_NAME_HELP = "only the broker set with this name (with --namesrv)"


def add_group(asub: SubParsers) -> argparse.ArgumentParser:
    """``txmq admin group update | list | delete``."""
    g = add_command(
        asub,
        "group",
        help="consumer-group configs: FIFO delivery and the retry limit",
        description=(
            "Consumer-group configs (RocketMQ's subscription groups). A FIFO group gets a\n"
            "queue's messages one batch at a time, in order; --retry-max is how often a\n"
            "failed message is retried before it goes to %%DLQ%%<group> (0 to 64, default\n"
            "16). A group nobody configured has the defaults (not FIFO, 16 retries).\n"
            "Through name servers a change is made on every master (or on --broker-name B)."
        ),
        examples="  txmq admin group update --group billing --fifo --retry-max 3\n"
        "  txmq admin group list --json\n"
        "  txmq admin group delete --group billing --namesrv 127.0.0.1:9876",
    )
    gsub = g.add_subparsers(dest="group_cmd", required=True, metavar="COMMAND")
    up = add_command(
        gsub,
        "update",
        help="create a consumer group's config, or change it",
        description=(
            "Create a consumer group's config (what is not given gets the default: not\n"
            "FIFO, 16 retries), or change what is given."
        ),
        examples="  txmq admin group update --group billing --fifo\n"
        "  txmq admin group update --group billing --no-fifo --retry-max 5\n"
        "  txmq admin group update --group billing --retry-max 0 --broker 127.0.0.1:10911",
    )
    up.add_argument("--group", required=True, help="consumer group")
    up.add_argument(
        "--fifo",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deliver each queue's messages in order, one batch at a time (--no-fifo: not)",
    )
    up.add_argument(
        "--retry-max",
        type=int,
        default=None,
        metavar="N",
        help="retries of a failed message before it becomes a dead letter (0 to 64)",
    )
    up.add_argument("--broker-name", help=BROKER_NAME_HELP)
    ls = add_command(
        gsub,
        "list",
        help="list configured consumer groups",
        description=(
            "List configured consumer groups. Through name servers each row names the\n"
            "broker sets that have that config."
        ),
        examples="  txmq admin group list\n  txmq admin group list --namesrv 127.0.0.1:9876 --json",
    )
    ls.add_argument("--broker-name", help=BROKER_NAME_HELP)
    de = add_command(
        gsub,
        "delete",
        help="delete a consumer group's config (it has the defaults again)",
        examples="  txmq admin group delete --group billing",
    )
    de.add_argument("--group", required=True, help="consumer group")
    de.add_argument("--broker-name", help=BROKER_NAME_HELP)
    return g


def run_group(args: argparse.Namespace) -> int:
    where = endpoints(args)
    cmd, name = args.group_cmd, args.broker_name

    async def run() -> list[GroupConfigRow] | bool:
        async with AdminClient(where["address"], namesrv=where["namesrv"]) as admin:
            if cmd == "update":
                return await admin.update_group(
                    args.group, fifo=args.fifo, retry_max_times=args.retry_max, broker=name
                )
            if cmd == "delete":
                return await admin.delete_group(args.group, broker=name)
            return await admin.groups(broker=name)

    result = anyio.run(run)
    if isinstance(result, bool):
        if not result:
            raise CommandError(f"consumer group {args.group!r} has no config: nothing deleted")
        if args.json:
            print(json.dumps([{"group": args.group, "deleted": True}], indent=2))
        else:
            print(f"consumer group {args.group}: config deleted (it has the defaults again)")
        return 0
    rows = [_row(r) for r in result]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table([{**r, "fifo": "yes" if r["fifo"] else "no"} for r in rows]))
    return 0


def _row(row: GroupConfigRow) -> dict[str, Any]:
    """A row as a dict; ``brokers`` only when a cluster filled it."""
    out: dict[str, Any] = msgspec.structs.asdict(row)
    if not out["brokers"]:
        del out["brokers"]
    return out
