"""A healthy transactional producer under load, for the reconciliation tests that run the
job beside it.

    python tests/spark/tx_load_proc.py --broker ADDR --group G --topic T --db ASYNC_URL
        --table ORDERS --prefix P [--max N] [--seconds S]

Runs local transactions through ``txmq.sqla.transaction`` one after another: each inserts
a business row ``(P-<i>, 1)`` into table ``ORDERS`` (columns id, amount) and sends one
message to ``T`` (keys ``[P-<i>]``), with a :class:`SqlTransactionChecker` answering any
check-back. Prints ``READY`` once connected, stops on SIGTERM (after the transaction under
way), after ``N`` transactions or after ``S`` seconds, whichever comes first, and prints
``DONE <count>``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import Any

import anyio
from sqlalchemy import Column, Integer, MetaData, String, Table, insert
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from txmq.client.transaction import TransactionProducer
from txmq.protocol.message import Message
from txmq.sqla import SqlTransactionChecker, transaction


def orders_table(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("id", String(64), primary_key=True),
        Column("amount", Integer, nullable=False),
    )


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--db", required=True, help="async SQLAlchemy URL")
    p.add_argument("--table", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--max", type=int, default=20_000)
    p.add_argument("--seconds", type=float, default=120.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    orders = orders_table(args.table)
    engine = create_async_engine(args.db)
    sessions = async_sessionmaker(engine)
    stop: list[int] = []

    def on_term(signum: int, frame: Any) -> None:
        stop.append(signum)

    signal.signal(signal.SIGTERM, on_term)
    deadline = time.monotonic() + args.seconds
    checker = SqlTransactionChecker(engine)
    n = 0
    async with TransactionProducer(args.broker, args.group, listener=checker) as producer:
        print("READY", flush=True)
        while n < args.max and time.monotonic() < deadline and not stop:
            order_id = f"{args.prefix}-{n}"
            async with transaction(producer, sessions) as tx:
                await tx.session.execute(insert(orders).values(id=order_id, amount=1))
                await tx.send(Message(args.topic, order_id.encode(), keys=[order_id]))
            n += 1
    await engine.dispose()
    print(f"DONE {n}", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
