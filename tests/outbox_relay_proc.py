"""An outbox relay in its own process that stops between sending and marking, for the
test that SIGKILLs it there.

Prints ``SENT <row ids>`` once its first cycle's rows are acknowledged by the broker, then
hangs inside the cycle's database transaction (the rows are still pending) until killed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio
from sqlalchemy.ext.asyncio import AsyncConnection

from txmq.outbox import OutboxRelay, Outcome, Row


class HangBeforeMark(OutboxRelay):
    async def _finish(
        self, conn: AsyncConnection, on: Any, outcome: Outcome, rows: list[Row]
    ) -> None:
        print("SENT " + ",".join(map(str, sorted(outcome.sent))), flush=True)
        await anyio.sleep_forever()


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--broker", required=True)
    p.add_argument("--claim-lease", type=float, default=30.0)
    args = p.parse_args(argv)
    relay = HangBeforeMark(args.db, args.broker, poll_interval=0.05, claim_lease=args.claim_lease)
    async with relay:
        print("READY", flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
