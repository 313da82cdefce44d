"""A push consumer in its own process, for tests that kill it.

Prints ``READY`` once started; appends one line per consumed message to ``--out``:
``<time> <msg id> <topic> <queue id> <queue offset> <reconsume times> <body>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import anyio

from txmq.consumer.push import PushConsumer
from txmq.protocol.message import MessageExt


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--instance", required=True)
    p.add_argument("--orderly", action="store_true")
    p.add_argument("--broadcasting", action="store_true")
    p.add_argument("--rebalance-interval", type=float, default=20.0)
    p.add_argument("--persist-interval", type=float, default=5.0)
    p.add_argument("--consume-delay", type=float, default=0.0)
    p.add_argument("--lock-renew-interval", type=float, default=20.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    fd = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def listener(msg: MessageExt) -> None:
        if args.consume_delay:
            await anyio.sleep(args.consume_delay)
        body = msg.body.decode()
        line = f"{time.time():.3f} {msg.msg_id} {msg.topic} {msg.queue_id} {msg.queue_offset} "
        line += f"{msg.reconsume_times} {body}\n"
        os.write(fd, line.encode())  # one O_APPEND write per message: whole lines only

    consumer = PushConsumer(
        args.broker,
        args.group,
        listener=listener,
        orderly=args.orderly,
        message_model="BROADCASTING" if args.broadcasting else "CLUSTERING",
        consume_from="FIRST_OFFSET",
        instance_name=args.instance,
        rebalance_interval=args.rebalance_interval,
        persist_interval=args.persist_interval,
        lock_renew_interval=args.lock_renew_interval,
        offset_dir=args.out + ".offsets",
    )
    consumer.subscribe(args.topic)
    async with consumer:
        print("READY", flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
