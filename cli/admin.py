"""``txmq admin``: topics, queue statistics, message lookups, offsets, the DLQ and
undecided transactions of a running broker, as tables or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

import anyio
import msgspec

from txmq.admin import AdminClient
from txmq.cli.options import SubParsers, add_command, share
from txmq.fmt import cell, format_table, ms_time, short_body
from txmq.message import Prop

__all__ = ["add_parser"]

Rows = tuple[list[dict[str, Any]], list[str] | None]

MESSAGE_COLUMNS = [
    "msg_id",
    "topic",
    "queue_id",
    "queue_offset",
    "tags",
    "keys",
    "store_timestamp",
    "body",
]


def _shared(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--broker",
        default=default,
        help="HOST:PORT (default $TXMQ_BROKER_ADDRESS or 127.0.0.1:10911)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=default if default is argparse.SUPPRESS else False,
        help="print JSON instead of a table",
    )


def add_parser(sub: SubParsers) -> None:
    a = add_command(
        sub,
        "admin",
        help="inspect a broker",
        examples="  txmq admin topics --broker 127.0.0.1:10911\n"
        "  txmq admin topic-stats orders --json\n"
        "  txmq admin message --key order-42\n"
        "  txmq admin dlq list --group billing\n"
        "  txmq admin transactions --parked",
    )
    asub = a.add_subparsers(dest="admin_cmd", required=True, metavar="COMMAND")
    add_command(asub, "topics", help="list topics")
    ts = add_command(asub, "topic-stats", help="per-queue offsets of a topic")
    ts.add_argument("topic")
    tc = add_command(asub, "topic-create", help="create or update a topic")
    tc.add_argument("topic")
    tc.add_argument("--queues", type=int, default=4)
    add_command(asub, "offsets", help="consumer-group offsets and lag")
    add_command(asub, "broker-info", help="broker runtime information")
    m = add_command(asub, "message", help="look a message up by id or key")
    g = m.add_mutually_exclusive_group(required=True)
    g.add_argument("--id", help="message id (or offset message id)")
    g.add_argument("--key", help="message key")
    m.add_argument("--max", type=int, default=32, help="most messages to show for --key")
    d = add_command(asub, "dlq", help="a consumer group's dead-letter queue")
    dsub = d.add_subparsers(dest="dlq_cmd", required=True, metavar="COMMAND")
    dl = add_command(dsub, "list", help="list dead letters of a consumer group")
    dl.add_argument("--group", required=True, help="consumer group")
    dl.add_argument("--offset", type=int, default=0, help="first DLQ queue offset to show")
    dl.add_argument("--max", type=int, default=32, help="most messages to show")
    dr = add_command(
        dsub,
        "resend",
        help="store dead letters again in %%RETRY%%<group> for the group to consume",
        description=(
            "Re-send dead letters to the group's retry topic at once (reconsume times reset "
            "to 0). The DLQ keeps its copy: re-sending the same message twice delivers it "
            "twice."
        ),
        examples="  txmq admin dlq resend --group billing --id 7F000001... --id 7F000001...\n"
        "  txmq admin dlq resend --group billing --all",
    )
    dr.add_argument("--group", required=True, help="consumer group")
    which = dr.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", action="append", help="message id (repeat for several)")
    which.add_argument("--all", action="store_true", help="every dead letter of the group")
    tx = add_command(
        asub,
        "transactions",
        help="undecided transactional (half) messages",
        description=(
            "Half messages whose producer has not committed or rolled them back yet "
            "(--pending), or that stayed undecided through every check-back and were parked "
            "for an operator (--parked)."
        ),
    )
    which_tx = tx.add_mutually_exclusive_group(required=True)
    which_tx.add_argument("--pending", action="store_true", help="waiting for a decision")
    which_tx.add_argument("--parked", action="store_true", help="parked after the last check")
    tx.add_argument("--group", help="only this producer group")
    tx.add_argument("--max", type=int, default=100, help="most transactions to show")
    share(a, _shared)
    a.set_defaults(func=run_admin)


def _dicts(items: list[Any]) -> list[dict[str, Any]]:
    return [msgspec.structs.asdict(item) for item in items]


def run_admin(args: argparse.Namespace) -> int:
    async def run() -> Rows:
        async with AdminClient(args.broker) as admin:
            return await _query(admin, args)

    rows, columns = anyio.run(run)
    if args.admin_cmd == "dlq" and args.dlq_cmd == "resend" and not args.json:
        print(f"re-sent {rows[0]['resent']} message(s) to %RETRY%{args.group}")
    elif args.json:
        print(json.dumps(rows, indent=2, default=str))
    elif args.admin_cmd == "message" and rows:
        for row in rows:
            for key, value in row.items():
                print(f"{key:>18}: {cell(value)}")
            print()
    else:
        print(format_table(rows, columns))
    return 0


async def _query(admin: AdminClient, args: argparse.Namespace) -> Rows:
    cmd = args.admin_cmd
    if cmd == "topics":
        return _dicts(await admin.topics()), ["topic", "queue_nums", "messages", "system"]
    if cmd == "topic-stats":
        return _dicts(await admin.topic_stats(args.topic)), None
    if cmd == "topic-create":
        return _dicts([await admin.create_topic(args.topic, args.queues)]), None
    if cmd == "offsets":
        return _dicts(await admin.offsets()), None
    if cmd == "broker-info":
        info = msgspec.structs.asdict(await admin.runtime_info())
        return [{"key": k, "value": v} for k, v in info.items()], None
    if cmd == "dlq":
        return await _dlq(admin, args)
    if cmd == "transactions":
        return await _transactions(admin, args)
    if cmd == "message":
        if args.id:
            msgs = [await admin.message_by_id(args.id)]
        else:
            msgs = await admin.messages_by_key(args.key, args.max)
        return [m.to_dict() for m in msgs], MESSAGE_COLUMNS
    raise SystemExit(f"unknown admin command {cmd}")  # pragma: no cover - argparse rejects it


async def _dlq(admin: AdminClient, args: argparse.Namespace) -> Rows:
    if args.dlq_cmd == "resend":
        resent = await admin.dlq_resend(args.group, None if args.all else args.id)
        return [{"group": args.group, "resent": resent}], None
    msgs = await admin.dlq_list(args.group, args.offset, args.max)
    if args.json:
        rows = []
        for m in msgs:
            row = m.to_dict(body_limit=None)
            row["origin_topic"] = m.get_property(Prop.RETRY_TOPIC) or m.topic
            row["origin_msg_id"] = m.get_property(Prop.ORIGIN_MESSAGE_ID)
            rows.append(row)
        return rows, None
    table = [
        {
            "msg_id": m.msg_id,
            "topic": m.get_property(Prop.RETRY_TOPIC) or m.topic,
            "reconsume_times": m.reconsume_times,
            "keys": m.keys,
            "store_time": ms_time(m.store_timestamp),
            "body": short_body(m.body),
        }
        for m in msgs
    ]
    return table, ["msg_id", "topic", "reconsume_times", "keys", "store_time", "body"]


async def _transactions(admin: AdminClient, args: argparse.Namespace) -> Rows:
    state = "parked" if args.parked else "pending"
    rows = await admin.transactions(state, args.max, group=args.group)
    if args.json:
        return _dicts(rows), None
    table = [
        {
            "msg_id": r.msg_id,
            "transaction_id": r.transaction_id,
            "group": r.group,
            "topic": f"{r.topic}/{r.queue_id}",
            "offset": r.transaction_offset,
            "born": ms_time(r.born_timestamp),
            "age_s": r.age_s,
            "checks": r.check_times,
        }
        for r in rows
    ]
    return table, list(table[0]) if table else None
