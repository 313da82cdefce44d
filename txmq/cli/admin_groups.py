"""``txmq admin group``: the consumer groups the brokers know (``list``), a group's live
members (``connections``, mqadmin's consumerConnection) and its progress per queue
(``progress``, consumerProgress); consumer-group configs (RocketMQ's SubscriptionGroupConfig) —
whether a group is FIFO (the broker delivers a queue's messages one batch at a time, in
order) and its retry limit (``retry_max_times``, 16 by default) — set, listed and deleted
on one broker or on every master of a cluster — and a group's offsets reset to a time
(RocketMQ's ``resetOffsetByTime``)."""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec

from txmq.cli.options import CommandError, SubParsers, add_command, endpoints
from txmq.cli.tables import table
from txmq.observability.fmt import iso_ms, ms_time, with_times

if TYPE_CHECKING:
    from txmq.admin.client import AdminClient
    from txmq.protocol.wire import GroupConfigRow, QueueReset

__all__ = ["add_group", "run_group"]

BROKER_NAME_HELP = "only the broker set with this name (with --namesrv)"


def add_group(asub: SubParsers) -> argparse.ArgumentParser:
    """``txmq admin group list | connections | progress | update | delete | reset-offset``."""
    g = add_command(
        asub,
        "group",
        help="consumer groups: members, progress, lag; configs (FIFO, the retry limit)",
        description=(
            "The consumer groups the brokers know (list), a group's live members\n"
            "(connections) and its offsets and lag per queue (progress). Configs (RocketMQ's\n"
            "subscription groups). A FIFO group gets a\n"
            "queue's messages one batch at a time, in order; --retry-max is how often a\n"
            "failed message is retried before it goes to %%DLQ%%<group> (0 to 64, default\n"
            "16). A group nobody configured has the defaults (not FIFO, 16 retries).\n"
            "Through name servers a change is made on every master (or on --broker-name B)."
        ),
        examples="  txmq admin group list\n"
        "  txmq admin group connections billing\n"
        "  txmq admin group progress billing --namesrv 127.0.0.1:9876\n"
        "  txmq admin group update --group billing --fifo --retry-max 3\n"
        "  txmq admin group list --json\n"
        "  txmq admin group delete --group billing --namesrv 127.0.0.1:9876\n"
        "  txmq admin group reset-offset --group billing --topic orders --to -1h",
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
        help="list the consumer groups the brokers know: members, lag, config",
        description=(
            "List the consumer groups the brokers know: those with members connected now,\n"
            "with committed offsets, or with a config. MEMBERS: clients connected now (over\n"
            "every broker set); LAG: messages not consumed yet, summed over every queue the\n"
            "group committed an offset of (- when it committed none); CONFIG: whether it\n"
            "has a config (else it has the defaults: not FIFO, 16 retries)."
        ),
        examples="  txmq admin group list\n  txmq admin group list --namesrv 127.0.0.1:9876 --json",
    )
    ls.add_argument("--broker-name", help=BROKER_NAME_HELP)
    co = add_command(
        gsub,
        "connections",
        help="a consumer group's live members: client id, address, subscriptions",
        description=(
            "A consumer group's members connected now (RocketMQ mqadmin's\n"
            "consumerConnection): each one's client id, address (as the broker sees it),\n"
            "subscriptions (topic=expression), consume type (CONCURRENTLY, ORDERLY) and\n"
            "message model (CLUSTERING, BROADCASTING), and seconds since its last heartbeat.\n"
            "Through name servers a member gets a row for each broker set it is connected to."
        ),
        examples="  txmq admin group connections billing\n"
        "  txmq admin group connections billing --namesrv 127.0.0.1:9876 --json",
    )
    co.add_argument("group", metavar="GROUP", help="consumer group")
    co.add_argument("--broker-name", help=BROKER_NAME_HELP)
    pr = add_command(
        gsub,
        "progress",
        help="a consumer group's offsets and lag, per queue",
        description=(
            "A consumer group's progress per queue (RocketMQ mqadmin's consumerProgress):\n"
            "the broker's offset (the queue's end), the group's committed offset, the lag\n"
            "between them and LAST_CONSUMED, the store time of the last message consumed\n"
            "(the one before the committed offset: - when the offset is 0 or that message is\n"
            "gone; read with one pull of one message per queue); then the total lag. Queues\n"
            "the group has committed no offset of are not listed."
        ),
        examples="  txmq admin group progress billing\n"
        "  txmq admin group progress billing --namesrv 127.0.0.1:9876 --json",
    )
    pr.add_argument("group", metavar="GROUP", help="consumer group")
    pr.add_argument("--broker-name", help=BROKER_NAME_HELP)
    de = add_command(
        gsub,
        "delete",
        help="delete a consumer group's config (it has the defaults again)",
        examples="  txmq admin group delete --group billing",
    )
    de.add_argument("--group", required=True, help="consumer group")
    de.add_argument("--broker-name", help=BROKER_NAME_HELP)
    _add_reset(gsub)
    return g


def _add_reset(gsub: SubParsers) -> None:
    rs = add_command(
        gsub,
        "reset-offset",
        help="move a consumer group's offsets of a topic to a time (consume again, or skip)",
        description=(
            "Move consumer group GROUP's offset of every queue of TOPIC to the first message\n"
            "stored at or after TIME (RocketMQ's resetOffsetByTime): back to consume again,\n"
            "or forward to skip. A time before the oldest message kept: the oldest; after the\n"
            "newest: the end. Connected push consumers of the group drop what they pulled and\n"
            "consume from there (messages in their listeners finish, their commits are\n"
            "ignored). Through name servers every broker set holding TOPIC is reset (or only\n"
            "--broker-name B). TIME: ISO 8601 (UTC unless it names a zone), -10m / -2h / -1d\n"
            "(that long ago), now, or ms since the epoch."
        ),
        examples="  txmq admin group reset-offset --group billing --topic orders --to -1h\n"
        "  txmq admin group reset-offset --group billing --topic orders "
        "--to 2026-11-25T10:00:00+01:00\n"
        "  txmq admin group reset-offset --group billing --topic orders --to now   # skip all\n"
        "  txmq admin group reset-offset --group billing --topic orders --to 1795600800000 "
        "--namesrv 127.0.0.1:9876 --json",
    )
    # "--to -10m" is a value, not an option (Python < 3.13 takes only "-10" for a number)
    rs._negative_number_matcher = re.compile(r"^-\d+(\.\d+)?(ms|s|m|h|d)?$")
    rs.add_argument("--group", required=True, help="consumer group")
    rs.add_argument("--topic", required=True, help="topic whose offsets move")
    rs.add_argument("--to", required=True, metavar="TIME", help="the time to move to")
    rs.add_argument(
        "--no-force",
        dest="force",
        action="store_false",
        help="only move offsets back (a queue already behind the time stays)",
    )
    rs.add_argument("--broker-name", help=BROKER_NAME_HELP)


def reset_time(text: str) -> int:
    """``--to``: ISO 8601 or ``-1h`` (as ``txmq reconcile --since`` reads them), ``now``,
    or ms since the epoch; as ms since the epoch."""
    from txmq.admin.client import epoch_ms
    from txmq.spark.job import BadOption, instant

    text = text.strip()
    if text == "now":
        return epoch_ms(datetime.now(UTC))
    if text.isdigit():
        return int(text)
    try:
        return epoch_ms(instant(text))
    except BadOption as exc:
        raise CommandError(f"--to: {exc}, now, or ms since the epoch") from None


def _run_reset(args: argparse.Namespace) -> int:
    import anyio

    from txmq.admin.client import AdminClient

    where = endpoints(args)
    to = reset_time(args.to)

    async def run() -> list[QueueReset]:
        async with AdminClient(where["address"], namesrv=where["namesrv"]) as admin:
            return await admin.reset_offsets(
                args.group, args.topic, to, broker=args.broker_name, force=args.force
            )

    rows = anyio.run(run)
    if args.json:
        out = [
            {**_row(r), "group": args.group, "topic": args.topic, "to": to, "to_time": iso_ms(to)}
            for r in rows
        ]
        print(json.dumps(out, indent=2))
        return 0
    print(f"consumer group {args.group}: offsets of {args.topic} reset to {ms_time(to)}")
    rows_out = [
        {"broker": r.broker_name, "queue": r.queue_id, "old": r.old_offset, "new": r.new_offset}
        for r in rows
    ]
    columns = ["queue", "old", "new"]
    if any(r.broker_name for r in rows):
        columns.insert(0, "broker")
    print(table(rows_out, columns, wide=args.wide))
    return 0


def run_group(args: argparse.Namespace) -> int:
    import anyio

    from txmq.admin.client import AdminClient

    if args.group_cmd == "reset-offset":
        return _run_reset(args)
    if args.group_cmd in ("list", "connections", "progress"):
        return _run_view(args)
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
            raise AssertionError(cmd)  # pragma: no cover - argparse allows no other

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
        print(table([{**r, "fifo": "yes" if r["fifo"] else "no"} for r in rows], wide=args.wide))
    return 0


#: what a narrow terminal leaves out first (the first first)
LIST_LOW_VALUE = ["brokers", "topics", "retry_max", "fifo"]
CONNECTIONS_LOW_VALUE = ["heartbeat_s", "model", "broker_name"]
PROGRESS_LOW_VALUE = ["last_consumed", "broker_name"]


def _run_view(args: argparse.Namespace) -> int:
    """``list``, ``connections`` and ``progress``."""
    import anyio

    from txmq.admin.client import AdminClient

    where = endpoints(args)

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with AdminClient(where["address"], namesrv=where["namesrv"]) as admin:
            return await _view(admin, args)

    raw, rows = anyio.run(run)
    if args.json:
        print(json.dumps(raw, indent=2))
        return 0
    cmd = args.group_cmd
    if cmd == "connections" and not rows:
        print(f"consumer group {args.group}: no member is connected")
    elif cmd == "progress" and not rows:
        print(f"consumer group {args.group}: no committed offset")
    else:
        drops = {"list": LIST_LOW_VALUE, "progress": PROGRESS_LOW_VALUE}
        drop = drops.get(cmd, CONNECTIONS_LOW_VALUE)
        print(table(rows, drop=drop, wide=args.wide))
        if cmd == "progress":
            print(f"total lag: {sum(r['lag'] for r in rows)}")
    return 0


async def _view(
    admin: AdminClient, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """JSON rows and table rows of ``list``, ``connections`` or ``progress``."""
    name = args.broker_name
    if args.group_cmd == "list":
        groups = [_row(g) for g in await admin.group_summaries(broker=name)]
        return groups, [
            {
                "group": g["group"],
                "members": g["members"],
                "lag": g["lag"],
                "config": "yes" if g["config"] else "no",
                "fifo": None if g["fifo"] is None else "yes" if g["fifo"] else "no",
                "retry_max": g["retry_max_times"],
                "topics": g["topics"],
                **({"brokers": g["brokers"]} if "brokers" in g else {}),
            }
            for g in groups
        ]
    if args.group_cmd == "connections":
        members = [_row(c) for c in await admin.consumer_connections(args.group, broker=name)]
        return members, [
            {
                **({"broker_name": c["broker_name"]} if "broker_name" in c else {}),
                "client_id": c["client_id"],
                "address": c["address"],
                "type": c["consume_type"],
                "model": c["message_model"],
                "subscriptions": c["subscriptions"],
                "heartbeat_s": c["heartbeat_age_s"],
            }
            for c in members
        ]
    offsets = [_row(o) for o in await admin.group_progress(args.group, broker=name)]
    return [with_times(o) for o in offsets], [
        {
            **({"broker_name": o["broker_name"]} if "broker_name" in o else {}),
            "topic": o["topic"],
            "queue_id": o["queue_id"],
            "broker_offset": o["max_offset"],
            "consumer_offset": o["offset"],
            "lag": o["lag"],
            "last_consumed": ms_time(o["last_consumed_timestamp"]),
        }
        for o in offsets
    ]


def _row(row: msgspec.Struct) -> dict[str, Any]:
    """A row as a dict; ``brokers`` / ``broker_name`` only when a cluster filled it."""
    out: dict[str, Any] = msgspec.structs.asdict(row)
    for name in ("brokers", "broker_name"):
        if name in out and not out[name]:
            del out[name]
    return out
