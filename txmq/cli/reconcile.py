"""``txmq reconcile``: the Spark reconciliation job (:mod:`txmq.spark.job`)."""

from __future__ import annotations

import argparse
import logging
import sys

from txmq.cli.options import SubParsers, add_command

__all__ = ["add_parser"]


def add_parser(sub: SubParsers) -> None:
    from txmq.spark.job import add_arguments

    r = add_command(
        sub,
        "reconcile",
        help="find lost, phantom, unconsumed, duplicate, parked and dead-lettered messages, "
        "and stuck or partly compensated sagas",
        description=(
            "A PySpark job over the broker's store (one per broker set of a cluster: its "
            "messages and its consumer groups' committed offsets) and txmq's tables in each "
            "database (transaction log, outbox, consumed keys, sagas and their barrier rows); "
            "writes a Parquet table per anomaly class and exits 1 if any needs attention. "
            "Standard error shows each phase with its duration (a live line on a terminal); "
            "Spark's own start-up notices and warnings are kept off it unless --spark-log "
            "(Spark's errors show either way)."
        ),
        examples="  txmq reconcile --store /var/lib/txmq --db sqlite:///orders.db "
        "--db sqlite:///inventory.db --sla 10m\n"
        "  txmq reconcile --store /var/lib/txmq --db postgresql+psycopg://app@db/orders "
        "--since -1h --expect billing=orders\n"
        "  txmq reconcile --store broker-a=/mnt/a/txmq --store broker-b=/mnt/b/txmq "
        "--db postgresql+psycopg://app@db/orders   # a cluster: a store per broker set\n"
        "  txmq reconcile --store /var/lib/txmq --db sqlite:///orders.db --spark-log"
        "   # Spark's own output too",
    )
    add_arguments(r)
    r.set_defaults(func=run_reconcile)


def run_reconcile(args: argparse.Namespace) -> int:
    from txmq.spark.job import BadOption, execute, options_from

    try:
        opts = options_from(args)
    except BadOption as exc:
        print(f"txmq reconcile: {exc}", file=sys.stderr)
        return 2
    if not opts.spark_log and logging.root.level > logging.DEBUG:
        # py4j's INFO line as the process ends ("Closing down clientserver connection")
        logging.getLogger("py4j").setLevel(logging.WARNING)
    return execute(opts)
