"""The ``txmq`` command: run a broker, inspect it, try it out."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from outbox.cli import add_outbox_parser
from spark.job import add_arguments as add_reconcile_arguments
from txmq.db import add_db_parser
from txmq.errors import TxmqError
from txmq.message import Prop
from txmq.settings import SettingsError

__all__ = ["format_table", "main"]


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table with a header row; numbers right-aligned."""
    if not rows:
        return "(none)"
    cols = list(columns or rows[0].keys())
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    numeric = [all(isinstance(r.get(c), int | float) for r in rows) for c in cols]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line([c.upper() for c in cols]), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


# -- broker -----------------------------------------------------------------------------------


def _broker_start(args: argparse.Namespace) -> int:
    from broker.config import BrokerConfig
    from broker.server import Broker

    overrides: dict[str, Any] = {
        "store": args.store,
        "host": args.host,
        "port": args.port,
        "flush": args.flush,
        "segment_size": args.segment_size,
    }
    if args.no_auto_create_topic:
        overrides["auto_create_topic"] = False
    config = BrokerConfig.load(args.config, **overrides)
    broker = Broker(config)

    async def run() -> None:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        logging.getLogger("txmq.broker").info(
                            "received %s; shutting down", signal.Signals(signum).name
                        )
                        broker.request_stop()
                        return

            async def serve(*, task_status: anyio.abc.TaskStatus[Any]) -> None:
                await broker.serve(task_status=task_status)
                tg.cancel_scope.cancel()

            tg.start_soon(on_signal)
            await tg.start(serve)
            if args.ready_file:
                Path(args.ready_file).write_text(broker.address)  # noqa: ASYNC240
            print(f"txmq broker listening on {broker.address}", flush=True)

    anyio.run(run)
    return 0


# -- admin ------------------------------------------------------------------------------------


def _admin(args: argparse.Namespace) -> int:
    from txmq.admin import AdminClient

    async def run() -> Any:
        async with AdminClient(args.broker) as admin:
            cmd = args.admin_cmd
            if cmd == "topics":
                return await admin.topics(), ["topic", "queue_nums", "messages", "system"]
            if cmd == "topic-stats":
                return await admin.topic_stats(args.topic), None
            if cmd == "topic-create":
                return [await admin.create_topic(args.topic, args.queues)], None
            if cmd == "offsets":
                return await admin.offsets(), None
            if cmd == "broker-info":
                info = await admin.runtime_info()
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
                return [m.to_dict() for m in msgs], [
                    "msg_id",
                    "topic",
                    "queue_id",
                    "queue_offset",
                    "tags",
                    "keys",
                    "store_timestamp",
                    "body",
                ]
            raise SystemExit(f"unknown admin command {cmd}")

    rows, columns = anyio.run(run)
    if args.admin_cmd == "dlq" and args.dlq_cmd == "resend" and not args.json:
        print(f"re-sent {rows[0]['resent']} message(s) to %RETRY%{args.group}")
    elif args.json:
        print(json.dumps(rows, indent=2, default=str))
    elif args.admin_cmd == "message" and rows:
        for row in rows:
            for key, value in row.items():
                print(f"{key:>18}: {_cell(value)}")
            print()
    else:
        print(format_table(rows, columns))
    return 0


async def _dlq(admin: Any, args: argparse.Namespace) -> tuple[list[dict[str, Any]], Any]:
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
            "store_time": _ms_time(m.store_timestamp),
            "body": _short_body(m.body),
        }
        for m in msgs
    ]
    return table, ["msg_id", "topic", "reconsume_times", "keys", "store_time", "body"]


async def _transactions(admin: Any, args: argparse.Namespace) -> tuple[list[dict[str, Any]], Any]:
    state = "parked" if args.parked else "pending"
    rows = await admin.transactions(state, args.max, group=args.group)
    if args.json:
        return rows, None
    table = [
        {
            "msg_id": r["msg_id"],
            "transaction_id": r["transaction_id"],
            "group": r["group"],
            "topic": f"{r['topic']}/{r['queue_id']}",
            "offset": r["transaction_offset"],
            "born": _ms_time(r["born_timestamp"]),
            "age_s": r["age_s"],
            "checks": r["check_times"],
        }
        for r in rows
    ]
    return table, [
        "msg_id",
        "transaction_id",
        "group",
        "topic",
        "offset",
        "born",
        "age_s",
        "checks",
    ]


def _ms_time(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"


def _short_body(body: bytes, limit: int = 40) -> str:
    try:
        text = body.decode()
    except UnicodeDecodeError:
        text = body.hex()
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- entry point ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="txmq", description="Transactional messaging for Python.")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("broker", help="run a broker").add_subparsers(
        dest="broker_cmd", required=True
    )
    start = b.add_parser("start", help="start a broker in the foreground")
    start.add_argument("--store", type=Path, help="storage folder (created if missing)")
    start.add_argument("--host", help="address to bind (default 127.0.0.1)")
    start.add_argument("--port", type=int, help="port (default 10911; 0 picks a free one)")
    start.add_argument("--flush", choices=["sync", "async"], help="commit-log flush mode")
    start.add_argument("--config", type=Path, help="TOML file with a [broker] table")
    start.add_argument("--segment-size", type=int, help="commit-log segment bytes")
    start.add_argument("--no-auto-create-topic", action="store_true")
    start.add_argument("--ready-file", help="write the bound address here once listening")
    start.set_defaults(func=_broker_start)

    a = sub.add_parser("admin", help="inspect a broker")
    a.add_argument("--broker", help="HOST:PORT (default $TXMQ_BROKER_ADDRESS or 127.0.0.1:10911)")
    a.add_argument("--json", action="store_true", help="print JSON instead of a table")
    asub = a.add_subparsers(dest="admin_cmd", required=True)
    asub.add_parser("topics", help="list topics")
    ts = asub.add_parser("topic-stats", help="per-queue offsets of a topic")
    ts.add_argument("topic")
    tc = asub.add_parser("topic-create", help="create or update a topic")
    tc.add_argument("topic")
    tc.add_argument("--queues", type=int, default=4)
    asub.add_parser("offsets", help="consumer-group offsets and lag")
    asub.add_parser("broker-info", help="broker runtime information")
    m = asub.add_parser("message", help="look a message up by id or key")
    g = m.add_mutually_exclusive_group(required=True)
    g.add_argument("--id", help="message id (or offset message id)")
    g.add_argument("--key", help="message key")
    m.add_argument("--max", type=int, default=32, help="most messages to show for --key")
    d = asub.add_parser("dlq", help="a consumer group's dead-letter queue")
    dsub = d.add_subparsers(dest="dlq_cmd", required=True)
    dl = dsub.add_parser("list", help="list dead letters of a consumer group")
    dl.add_argument("--group", required=True, help="consumer group")
    dl.add_argument("--offset", type=int, default=0, help="first DLQ queue offset to show")
    dl.add_argument("--max", type=int, default=32, help="most messages to show")
    dr = dsub.add_parser(
        "resend",
        help="store dead letters again in %%RETRY%%<group> for the group to consume",
        description=(
            "Re-send dead letters to the group's retry topic at once (reconsume times reset "
            "to 0). The DLQ keeps its copy: re-sending the same message twice delivers it "
            "twice."
        ),
    )
    dr.add_argument("--group", required=True, help="consumer group")
    which = dr.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", action="append", help="message id (repeat for several)")
    which.add_argument("--all", action="store_true", help="every dead letter of the group")
    tx = asub.add_parser(
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
    for sp in (dl, dr, tx):
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    a.set_defaults(func=_admin)

    add_db_parser(sub)
    add_outbox_parser(sub)

    r = sub.add_parser(
        "reconcile",
        help="find lost, phantom, unconsumed, duplicate, parked and dead-lettered messages",
        description=(
            "A PySpark job over the broker's store and txmq's tables in each database; "
            "writes a Parquet table per anomaly class and exits 1 if any needs attention."
        ),
    )
    add_reconcile_arguments(r)
    r.set_defaults(func=_reconcile)

    q = sub.add_parser("quickstart", help="broker in a temporary folder; send and receive")
    q.add_argument("--messages", type=int, default=1000)
    q.set_defaults(func=_quickstart)
    return p


def _reconcile(args: argparse.Namespace) -> int:
    from spark.job import BadOption, execute, options_from

    try:
        opts = options_from(args)
    except BadOption as exc:
        print(f"txmq reconcile: {exc}", file=sys.stderr)
        return 2
    return execute(opts)


def _quickstart(args: argparse.Namespace) -> int:
    from txmq.quickstart import run_quickstart

    return run_quickstart(args.messages)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except (TxmqError, SettingsError, OSError, ValueError) as exc:
        print(f"txmq: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
