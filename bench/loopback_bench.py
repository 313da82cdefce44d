"""The test harness (txmq.testing) against its peer, a broker on TCP in the same process:
how long a fixture takes to start, and a message's round trip from send to listener.

    .venv/bin/python bench/loopback_bench.py [--rounds 5] [--messages 500]

Each round, in rotating order, for each way of reaching a broker:

- **loopback**: an ``InProcessBroker`` (the ``txmq_broker`` fixture's broker), its clients
  on the loopback transport (typed requests handed to the broker's router);
- **tcp**: the same broker code as an ``EmbeddedBroker`` in the same process, its clients on
  txmq's protocol over a loopback TCP socket (what tests used before the harness).

start-up: from nothing to a broker serving (a fresh store in a temporary folder) and back.
round trip: one message at a time, from ``send`` to the push consumer's listener, the next
sent once it arrived (p50 / p99 over ``--messages``).  Goals: start-up <= 100 ms, loopback
p50 <= 1 ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from txmq import ConsumeFrom, Message, MessageExt, Producer, PushConsumer  # noqa: E402
from txmq.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from txmq.testing import InProcessBroker  # noqa: E402


class Way:
    """A broker and how clients reach it."""

    name = ""

    def start(self, store: Path) -> None: ...

    def stop(self) -> None: ...

    def client(self) -> dict[str, Any]:
        return {}


class Loopback(Way):
    name = "loopback"

    def start(self, store: Path) -> None:
        self.broker = InProcessBroker(store).start()

    def stop(self) -> None:
        self.broker.stop()

    def client(self) -> dict[str, Any]:
        return {"address": self.broker.address, "transport": "loopback"}


class Tcp(Way):
    name = "tcp"

    def start(self, store: Path) -> None:
        config = BrokerConfig(store=store, port=0, grpc_port=0, metrics_port=0)
        self.broker = EmbeddedBroker(config).start()

    def stop(self) -> None:
        self.broker.stop()

    def client(self) -> dict[str, Any]:
        return {"address": self.broker.address, "transport": "txmq"}


def start_up(way: Way) -> float:
    """Seconds from nothing to a serving broker and back."""
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        way.start(Path(tmp) / "store")
        started = time.perf_counter() - began
        way.stop()
    return started


async def round_trips(way: Way, messages: int) -> list[float]:
    """Seconds from send to the listener, one message at a time."""
    kw = way.client()
    address = kw.pop("address")
    arrived = anyio.Event()
    took: list[float] = []
    sent_at = 0.0

    async def listener(msg: MessageExt) -> None:
        took.append(time.perf_counter() - sent_at)
        arrived.set()

    consumer = PushConsumer(
        address, "bench", listener=listener, consume_from=ConsumeFrom.FIRST_OFFSET, **kw
    )
    consumer.subscribe("rtt")
    async with Producer(address, **kw) as producer:
        await producer.send(Message("rtt", b"warm-up"))  # the topic exists before consuming
        async with consumer:
            with anyio.fail_after(30):
                await arrived.wait()
            took.clear()
            for i in range(messages):
                arrived = anyio.Event()
                sent_at = time.perf_counter()
                await producer.send(Message("rtt", b"%d" % i))
                with anyio.fail_after(30):
                    await arrived.wait()
    return took


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--messages", type=int, default=500)
    args = ap.parse_args(argv)
    ways: list[Callable[[], Way]] = [Loopback, Tcp]
    starts: dict[str, list[float]] = {w().name: [] for w in ways}
    trips: dict[str, list[float]] = {w().name: [] for w in ways}
    for r in range(args.rounds):
        order = ways[r % len(ways) :] + ways[: r % len(ways)]  # rotate: A/B, B/A, ...
        for make in order:
            way = make()
            starts[way.name].append(start_up(way))
            with tempfile.TemporaryDirectory() as tmp:
                way.start(Path(tmp) / "store")
                try:
                    trips[way.name] += anyio.run(round_trips, way, args.messages)
                finally:
                    way.stop()
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{args.rounds} rounds, {args.messages} round trips each (rotating order)")
    print(f"{'way':<10} {'start-up median ms':>19} {'max ms':>8} {'rtt p50 ms':>11} {'p99 ms':>8}")
    for name in starts:
        s, t = starts[name], trips[name]
        print(
            f"{name:<10} {statistics.median(s) * 1000:>19.1f} {max(s) * 1000:>8.1f} "
            f"{p(t, 0.5) * 1000:>11.3f} {p(t, 0.99) * 1000:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
