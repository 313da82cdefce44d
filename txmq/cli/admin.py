"""``txmq admin``: topics, consumer-group configs, queue statistics, message lookups,
offsets, the DLQ and undecided transactions of a running broker — or of a whole cluster
through its name servers (``--namesrv``) — as tables or JSON.

Times: tables show local time with milliseconds (like the log lines). ``--json`` keeps
each epoch-millisecond field (``store_timestamp``, ...) as the broker sent it, for scripts
to compute with, and adds an ISO 8601 UTC string beside it (``store_time``), which reads
the same on every machine."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from txmq.cli.admin_acl import add_acl, run_acl
from txmq.cli.admin_groups import add_group, run_group
from txmq.cli.admin_ha import (
    add_controller_option,
    add_switchover,
    cluster_output,
    run_switchover,
)
from txmq.cli.admin_sagas import add_sagas, run_sagas
from txmq.cli.admin_transactions import add_transactions, run_decide
from txmq.cli.options import (
    CommandError,
    SubParsers,
    add_command,
    add_endpoints,
    endpoints,
    share,
)
from txmq.cli.tables import table
from txmq.observability.fmt import cell, ms_time, with_times

if TYPE_CHECKING:
    from txmq.admin.client import AdminClient
    from txmq.cli.admin_views import Rows

__all__ = ["add_parser"]

BROKER_NAME_HELP = "only the broker set with this name (with --namesrv)"


def _shared(parser: argparse.ArgumentParser, default: object) -> None:
    add_endpoints(parser, default)
    parser.add_argument(
        "--json",
        action="store_true",
        default=default if default is argparse.SUPPRESS else False,
        help="print JSON instead of a table",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        default=default if default is argparse.SUPPRESS else False,
        help="every column of a table, however wide (tables fit $COLUMNS or the terminal)",
    )


def add_parser(sub: SubParsers) -> None:
    a = add_command(
        sub,
        "admin",
        help="inspect a broker or a cluster",
        description=(
            "Inspect one broker (--broker HOST:PORT) or a whole cluster through its name "
            "servers (--namesrv 'H1:P1;H2:P2', or $TXMQ_NAMESRV_ADDR): through name servers "
            "every command asks every broker and each row names its broker set."
        ),
        examples="  txmq admin topics --broker 127.0.0.1:10911\n"
        "  txmq admin cluster --namesrv '127.0.0.1:9876;127.0.0.1:9877'\n"
        "  txmq admin switchover --broker-name broker-a --to 1 --namesrv 127.0.0.1:9876\n"
        "  txmq admin topic-create orders --queues 8 --cluster C --namesrv 127.0.0.1:9876\n"
        "  txmq admin route orders --namesrv 127.0.0.1:9876\n"
        "  txmq admin topic-stats orders --json\n"
        "  txmq admin message --key order-42\n"
        "  txmq admin group update --group billing --fifo --retry-max 3\n"
        "  txmq admin dlq list --group billing\n"
        "  txmq admin transactions --parked\n"
        "  txmq admin transactions commit --id 7F0000010A2B... --reason 'order 42 was paid'\n"
        "  txmq admin sagas list --db sqlite:///orders.db --state PARKED\n"
        "  txmq admin user create orders-service       # as TXMQ_ACCESS_KEY, a super user\n"
        "  txmq admin acl add orders-service topic:orders pub",
    )
    asub = a.add_subparsers(dest="admin_cmd", required=True, metavar="COMMAND")
    cl = add_command(
        asub,
        "cluster",
        help="the brokers of a cluster: address, role, version, uptime, load, lag",
        description=(
            "The brokers of a cluster: address, role (SYNC_MASTER, ASYNC_MASTER, SLAVE), own\n"
            "broker id, epoch, a slave's lag behind its master (bytes, and seconds since it\n"
            "last had everything), version, uptime, load and consumer lag; then, for\n"
            "replicated broker sets, each set's master, epoch and in-sync slaves, and the\n"
            "controller's view of the set (--controller, else a name server that hosts one,\n"
            "else the controller the brokers heartbeat to)."
        ),
        examples="  txmq admin cluster --namesrv '127.0.0.1:9876;127.0.0.1:9877'\n"
        "  txmq admin cluster --broker 127.0.0.1:10911 --json\n"
        "  txmq admin cluster --namesrv 127.0.0.1:9876 --controller 127.0.0.1:9878",
    )
    sw = add_switchover(asub)
    rt = add_command(
        asub,
        "route",
        help="which broker sets hold a topic's queues, and where they are",
        examples="  txmq admin route orders --namesrv 127.0.0.1:9876",
    )
    rt.add_argument("topic")
    add_command(
        asub,
        "topics",
        help="list topics (through name servers: queue counts summed over broker sets)",
        examples="  txmq admin topics --broker 127.0.0.1:10911\n"
        "  txmq admin topics --namesrv '127.0.0.1:9876;127.0.0.1:9877' --json",
    )
    ts = add_command(
        asub,
        "topic-stats",
        help="per-queue offsets of a topic",
        examples="  txmq admin topic-stats orders --broker 127.0.0.1:10911\n"
        "  txmq admin topic-stats orders --namesrv 127.0.0.1:9876 --json",
    )
    ts.add_argument("topic")
    tc = add_command(
        asub,
        "topic-create",
        help="create or update a topic",
        description=(
            "Create a topic, or change its queue count. Through name servers: on every "
            "master of --cluster C, or on the broker set --broker-name B (with neither, on "
            "every master of the only cluster there is)."
        ),
        examples="  txmq admin topic-create orders --queues 8 --broker 127.0.0.1:10911\n"
        "  txmq admin topic-create orders --queues 8 --cluster C --namesrv 127.0.0.1:9876\n"
        "  txmq admin topic-create orders --broker-name broker-b --namesrv 127.0.0.1:9876",
    )
    tc.add_argument("topic")
    tc.add_argument("--queues", type=int, default=4, help="queues on each broker set (4)")
    where = tc.add_mutually_exclusive_group()
    where.add_argument("--cluster", help="every master of this cluster (with --namesrv)")
    where.add_argument("--broker-name", help="the broker set with this name (with --namesrv)")
    tp = add_command(asub, "topic", help="a topic: delete it")
    tsub = tp.add_subparsers(dest="topic_cmd", required=True, metavar="COMMAND")
    td = add_command(
        tsub,
        "delete",
        help="delete a topic from every broker set holding it (asks for --yes)",
        description=(
            "Delete a topic: its config and its queues on every broker set holding it (or\n"
            "on --broker-name B alone), and its route at the name servers when the brokers\n"
            "next register. Its messages can no longer be consumed. Refused without --yes."
        ),
        examples="  txmq admin topic delete orders --yes\n"
        "  txmq admin topic delete orders --yes --namesrv 127.0.0.1:9876 --broker-name broker-b",
    )
    td.add_argument("topic")
    td.add_argument("--yes", action="store_true", help="yes, delete it")
    td.add_argument("--broker-name", help=BROKER_NAME_HELP)
    add_command(
        asub,
        "offsets",
        help="consumer-group offsets and lag",
        examples="  txmq admin offsets --broker 127.0.0.1:10911\n"
        "  txmq admin offsets --namesrv 127.0.0.1:9876 --json",
    )
    bi = add_command(
        asub,
        "broker-info",
        help="broker runtime information",
        examples="  txmq admin broker-info --broker 127.0.0.1:10911\n"
        "  txmq admin broker-info --namesrv 127.0.0.1:9876 --broker-name broker-a --json",
    )
    bi.add_argument("--broker-name", help=BROKER_NAME_HELP)
    m = add_command(
        asub,
        "message",
        help="look a message up by id or key",
        examples="  txmq admin message --id 7F0000010A2B00002A9F... --broker 127.0.0.1:10911\n"
        "  txmq admin message --key order-42 --max 10 --namesrv 127.0.0.1:9876 --json",
    )
    g = m.add_mutually_exclusive_group(required=True)
    g.add_argument("--id", help="message id (or offset message id)")
    g.add_argument("--key", help="message key")
    m.add_argument("--max", type=int, default=32, help="most messages to show for --key")
    m.add_argument("--broker-name", help=BROKER_NAME_HELP)
    d = add_command(asub, "dlq", help="a consumer group's dead-letter queue")
    dsub = d.add_subparsers(dest="dlq_cmd", required=True, metavar="COMMAND")
    dl = add_command(
        dsub,
        "list",
        help="list dead letters of a consumer group",
        description=(
            "List dead letters of a consumer group: ORIGIN_TOPIC is the topic each was first\n"
            "sent to (in --json: origin_topic; topic is the DLQ's, %DLQ%<group>). Each broker\n"
            "set has a DLQ of its own: through name servers --offset and --max apply to each."
        ),
        examples="  txmq admin dlq list --group billing --broker 127.0.0.1:10911\n"
        "  txmq admin dlq list --group billing --offset 32 --max 32 --json",
    )
    dl.add_argument("--group", required=True, help="consumer group")
    dl.add_argument("--offset", type=int, default=0, help="first DLQ queue offset to show")
    dl.add_argument("--max", type=int, default=32, help="most messages to show")
    dl.add_argument("--broker-name", help=BROKER_NAME_HELP)
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
    dr.add_argument("--broker-name", help=BROKER_NAME_HELP)
    add_transactions(asub, _shared)
    add_sagas(asub)
    add_group(asub)
    add_acl(asub)
    share(a, _shared)
    add_controller_option(a, None)  # before the subcommand, or after these two
    for leaf in (cl, sw):
        add_controller_option(leaf, argparse.SUPPRESS)
    a.set_defaults(func=run_admin)


def run_admin(args: argparse.Namespace) -> int:
    import anyio

    from txmq.admin.client import AdminClient
    from txmq.cli.admin_views import cluster_note, low_value, query

    if args.controller and args.admin_cmd not in ("cluster", "switchover"):
        raise CommandError("--controller is for 'txmq admin cluster' and 'txmq admin switchover'")
    if args.admin_cmd == "switchover":
        return run_switchover(args)
    if args.admin_cmd == "group":
        return run_group(args)
    if args.admin_cmd in ("user", "acl"):
        return run_acl(args)
    if args.admin_cmd == "sagas":
        return run_sagas(args)
    if args.admin_cmd == "transactions":
        if args.tx_cmd:
            return run_decide(args)
        if not (args.pending or args.parked or args.decided):
            raise CommandError(
                "say which: --pending, --parked or --decided (or a command: commit, rollback, "
                "recheck)"
            )
    if args.admin_cmd == "topic":
        return _delete_topic(args)
    where = endpoints(args)

    async def client() -> AdminClient:
        return AdminClient(where["address"], namesrv=where["namesrv"])

    if args.admin_cmd == "cluster":

        async def cluster() -> str:
            async with await client() as admin:
                return await cluster_output(admin, args)

        print(anyio.run(cluster))
        return 0

    async def run() -> tuple[Rows, str | None]:
        async with await client() as admin:
            return await query(admin, args), await cluster_note(admin, args)

    (rows, columns), note = anyio.run(run)
    if note:
        print(note, file=sys.stderr)
    if args.json:
        rows = [with_times(row) for row in rows]
    else:
        rows = [with_times(row, readable=ms_time, keep_ms=False) for row in rows]
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
        print(table(rows, columns, drop=low_value(args), wide=args.wide))
    return 0


def _delete_topic(args: argparse.Namespace) -> int:
    import anyio

    from txmq.admin.client import AdminClient

    if not args.yes:
        raise CommandError(
            f"deleting topic {args.topic!r} drops its queues and messages: add --yes to do it"
        )
    where = endpoints(args)

    async def run() -> None:
        async with AdminClient(where["address"], namesrv=where["namesrv"]) as admin:
            await admin.delete_topic(args.topic, broker=args.broker_name)

    anyio.run(run)
    if args.json:
        print(json.dumps([{"topic": args.topic, "deleted": True}], indent=2))
    else:
        where_ = (
            f"broker set {args.broker_name}" if args.broker_name else "every broker set holding it"
        )
        print(f"topic {args.topic} deleted (from {where_})")
    return 0
