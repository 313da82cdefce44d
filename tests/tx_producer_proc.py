"""A transactional producer in its own process, for tests that kill it.

Sends ``--count`` half messages to ``--topic`` (transaction ids ``<--tx-prefix>-<i>``)
and never ends them; prints ``READY <json list of {msg_id, transaction_id,
transaction_offset}>``, then stays alive answering every check-back with UNKNOWN (one line
``CHECK <transaction id>`` on stdout per check) until it is killed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import anyio

from txmq.client.transaction import LocalTransactionState, TransactionProducer
from txmq.protocol.message import Message, MessageExt, Prop


class Undecided:
    def execute_local_transaction(self, msg: Message, arg: object) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        print(f"CHECK {msg.get_property(Prop.TRANSACTION_ID)}", flush=True)
        return LocalTransactionState.UNKNOWN


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--tx-prefix", default="tx")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    async with TransactionProducer(args.broker, args.group, listener=Undecided()) as producer:
        sent = []
        for i in range(args.count):
            tx_id = f"{args.tx_prefix}-{i}"
            r = await producer.send_half(
                Message(args.topic, f"{tx_id} body".encode()), transaction_id=tx_id
            )
            sent.append(
                {
                    "msg_id": r.msg_id,
                    "transaction_id": tx_id,
                    "transaction_offset": r.transaction_offset,
                }
            )
        print(f"READY {json.dumps(sent)}", flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
