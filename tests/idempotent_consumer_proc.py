"""A push consumer with an idempotent (sync) handler in its own process, for the tests
that kill it inside the handler.

Prints ``READY`` once started and ``ENTERED <body>`` when the handler gets the message
whose body is ``--hang-on``; it then hangs there (its database transaction, or its
``consuming`` mark, open) until killed. Other messages are applied: transaction mode
inserts an ``effects`` row through the handler's session; mark mode appends a line
``<key> <body>`` to ``--out`` (an effect outside the database).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import anyio
from sqlalchemy import create_engine, insert
from sqlalchemy.orm import Session

import txmq
from tests.outbox_support import effects
from txmq import ConsumeFrom, MessageExt, PushConsumer


def make_listener(args: argparse.Namespace) -> Any:
    engine = create_engine(args.db)

    def hang_if_asked(msg: MessageExt) -> None:
        if msg.body.decode() == args.hang_on:
            print(f"ENTERED {args.hang_on}", flush=True)
            time.sleep(3600)

    if args.mode == "transaction":

        @txmq.idempotent(engine, group=args.group)
        def apply(msg: MessageExt, session: Session) -> None:
            session.execute(insert(effects).values(key=msg.keys[0], body=msg.body.decode()))
            hang_if_asked(msg)

        return apply

    @txmq.idempotent(engine, group=args.group, mode="mark", expiry=args.expiry)
    def apply_outside(msg: MessageExt) -> None:
        hang_if_asked(msg)
        fd = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{msg.keys[0]} {msg.body.decode()}\n".encode())
        finally:
            os.close(fd)

    return apply_outside


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--mode", choices=["transaction", "mark"], default="transaction")
    p.add_argument("--hang-on", default="")
    p.add_argument("--expiry", type=float, default=60.0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    consumer = PushConsumer(
        args.broker,
        args.group,
        listener=make_listener(args),
        consume_from=ConsumeFrom.FIRST_OFFSET,
    )
    consumer.subscribe(args.topic)
    async with consumer:
        print("READY", flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
