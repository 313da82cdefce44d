"""A producer process running ``txmq.sqla.transaction``, for tests that SIGKILL it at a
chosen point of the local transaction.

    python tests/sqla_producer_proc.py --broker ADDR --group G --topic T --db ASYNC_URL
        --table ORDERS --order-id ID --transaction-id TID [--messages N]
        --stop before-db-commit|after-db-commit

Inside ``async with transaction(producer, session, transaction_id=TID)`` it inserts one row
``(ID, 42, 'new')`` into table ``ORDERS`` (columns id, amount, status) and sends N half
messages to ``T`` (body ``<ID> <i>``, keys ``[ID]``), then stops:

- ``before-db-commit``: prints ``HALF-SENT <TID>`` and sleeps inside the block — the
  database transaction is open (its log row locked), the halves are stored.
- ``after-db-commit``: lets the block end, so the session commits; then, where the context
  manager would send COMMIT to the broker, the test hook below prints
  ``DB-COMMITTED <TID> <state>`` and sleeps instead. The hook is this script's own:
  the producer's ``end_transaction`` is replaced on this one instance; no library code
  knows about it.

Either way the test kills the process on that line (SIGKILL), with the transaction exactly
there. Its own listener answers every check-back UNKNOWN (one ``CHECK <transaction id>``
line each), so whatever becomes of the transaction is decided by *another* producer of the
group. Prints ``READY`` once connected; stderr gets the logs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import anyio
from sqlalchemy import Column, Integer, MetaData, String, Table, insert
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from txmq.client.producer import SendResult
from txmq.client.transaction import LocalTransactionState, TransactionProducer
from txmq.protocol.message import Message, MessageExt, Prop
from txmq.sqla import transaction


class Undecided:
    """Answers every check-back UNKNOWN: this process never resolves anything itself."""

    def execute_local_transaction(self, msg: Message, arg: object) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        print(f"CHECK {msg.get_property(Prop.TRANSACTION_ID)}", flush=True)
        return LocalTransactionState.UNKNOWN


def orders_table(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("id", String(64), primary_key=True),
        Column("amount", Integer, nullable=False),
        Column("status", String(16), nullable=False),
    )


def hang_instead_of_ending(producer: TransactionProducer, transaction_id: str) -> None:
    """The test hook: the first COMMIT/ROLLBACK this producer would send to the broker —
    which ``transaction()`` sends only after the database commit (or rollback) — prints
    ``DB-COMMITTED <id> <state>`` and blocks until the process is killed."""

    async def end_transaction(result: SendResult, state: Any, **options: Any) -> str:
        print(f"DB-COMMITTED {transaction_id} {LocalTransactionState(state).value}", flush=True)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    producer.end_transaction = end_transaction  # type: ignore[method-assign]


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--db", required=True, help="async SQLAlchemy URL")
    p.add_argument("--table", required=True)
    p.add_argument("--order-id", required=True)
    p.add_argument("--transaction-id", required=True)
    p.add_argument("--messages", type=int, default=1)
    p.add_argument("--stop", choices=["before-db-commit", "after-db-commit"], required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    orders = orders_table(args.table)
    engine = create_async_engine(args.db)
    tid = args.transaction_id
    async with TransactionProducer(args.broker, args.group, listener=Undecided()) as producer:
        if args.stop == "after-db-commit":
            hang_instead_of_ending(producer, tid)
        print("READY", flush=True)
        async with AsyncSession(engine) as session:
            async with transaction(producer, session, transaction_id=tid) as tx:
                await session.execute(
                    insert(orders).values(id=args.order_id, amount=42, status="new")
                )
                for i in range(args.messages):
                    body = f"{args.order_id} {i}".encode()
                    await tx.send(Message(args.topic, body, keys=[args.order_id]))
                if args.stop == "before-db-commit":
                    print(f"HALF-SENT {tid}", flush=True)
                    await anyio.sleep_forever()
        raise AssertionError("the end of the block should never return here")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
