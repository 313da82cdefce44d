"""What the broker's Prometheus metrics cost: produce and consume on a broker with metrics
on vs one with them off, alternating, in one run.

    python bench/metrics_bench.py [--messages 20000] [--size 1024] [--window 128]
                                  [--rounds 5] [--scrape-interval 1.0] [--aa]
                                  [--json out.json]

Two ``txmq broker start`` processes (async flush, stores in a temporary folder): one with
``--metrics-port`` on a free port, one with ``--metrics-port 0``.  Each round runs, on
each broker in turn (off, on; then on, off in the next round, so neither always goes
first): ``--messages`` sends of ``--size`` bytes from one asyncio ``txmq.Producer`` with at
most ``--window`` unacknowledged, to a topic of its own (4 queues), then a
``txmq.PushConsumer`` of a new group draining it from the first offset.  While the
metrics broker works, this process scrapes its ``/metrics`` every ``--scrape-interval``
seconds (Prometheus' default is 15 s or 60 s: 1 s is harsh on purpose).  Reported per
phase: messages per second and the broker process's CPU per message (``/proc/<pid>/stat``,
user + system), the median over the rounds and the on/off ratio of the medians.  At the
end both brokers get SIGTERM (by PID) and the folder is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Node, free_port, run_windowed  # noqa: E402
from txmq import AdminClient, Message, Producer, PushConsumer  # noqa: E402
from txmq.protocol.message import MessageExt  # noqa: E402

QUEUES = 4


@dataclass
class Broker:
    name: str
    metrics_port: int  # 0: off
    tmp: Path
    node: Node | None = None
    address: str = ""
    produce: list[tuple[float, float]] = field(default_factory=list)  # (msg/s, CPU µs/msg)
    consume: list[tuple[float, float]] = field(default_factory=list)
    scrapes: int = 0
    scrape_bytes: int = 0

    @property
    def key(self) -> str:
        return self.name.split()[0].lower()

    def start(self) -> None:
        argv = [
            *("broker", "start", "--store", str(self.tmp / self.key), "--grpc-port", "0"),
            *("--metrics-port", str(self.metrics_port)),
        ]
        self.node = Node(f"broker-{self.key}", argv, self.tmp, timeout=30)
        self.address = self.node.start().wait_ready()

    def stop(self) -> None:
        if self.node is not None:
            self.node.stop()

    def cpu(self) -> float:
        assert self.node is not None
        return self.node.cpu()


async def _scrape(broker: Broker, interval: float) -> None:
    """GET /metrics every ``interval`` seconds until cancelled."""
    while True:
        await asyncio.sleep(interval)
        reader, writer = await asyncio.open_connection("127.0.0.1", broker.metrics_port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
        data = await reader.read()
        writer.close()
        assert data.startswith(b"HTTP/1.1 200"), data[:80]
        broker.scrapes += 1
        broker.scrape_bytes = len(data)


async def _round(broker: Broker, r: int, args: argparse.Namespace) -> None:
    topic, body, n = f"bench{r}", b"x" * args.size, args.messages
    async with AdminClient(broker.address) as admin:
        await admin.create_topic(topic, QUEUES)
    scraper = (
        asyncio.create_task(_scrape(broker, args.scrape_interval)) if broker.metrics_port else None
    )
    try:
        async with Producer(broker.address, "bench-producer") as producer:
            msg = Message(topic, body)

            async def send_one(i: int) -> None:
                await producer.send(msg)

            await run_windowed(2 * args.window, args.window, send_one)  # warm-up
            cpu0 = broker.cpu()
            elapsed = await run_windowed(n, args.window, send_one)
            broker.produce.append((n / elapsed, (broker.cpu() - cpu0) / n * 1e6))
        total = n + 2 * args.window
        done = asyncio.Event()
        count = 0

        async def listener(m: MessageExt) -> None:
            nonlocal count
            count += 1
            if count >= total:
                done.set()

        cpu0, t0 = broker.cpu(), time.perf_counter()
        consumer = PushConsumer(
            broker.address,
            f"bench-consume-{r}",
            listener=listener,
            consume_from="FIRST_OFFSET",
            pull_batch_size=64,
        )
        consumer.subscribe(topic)
        await consumer.start()
        try:
            await asyncio.wait_for(done.wait(), 300)
            elapsed = time.perf_counter() - t0
            broker.consume.append((total / elapsed, (broker.cpu() - cpu0) / total * 1e6))
        finally:
            await consumer.stop()
    finally:
        if scraper is not None:
            scraper.cancel()
            try:
                await scraper
            except asyncio.CancelledError:
                pass


def _median(values: list[tuple[float, float]], i: int) -> float:
    return statistics.median(v[i] for v in values)


def report(off: Broker, on: Broker, args: argparse.Namespace) -> dict[str, Any]:
    print(
        f"\n{args.messages} messages of {args.size} B per phase, window {args.window}, "
        f"{args.rounds} rounds; /metrics scraped every {args.scrape_interval} s "
        f"({on.scrapes} scrapes, {on.scrape_bytes} bytes the last)\n"
    )
    print("| phase | metrics | msg/s median | each round | broker CPU µs/msg median |")
    print("|---|---|---|---|---|")
    out: dict[str, Any] = {}
    for phase in ("produce", "consume"):
        for b in (off, on):
            runs: list[tuple[float, float]] = getattr(b, phase)
            each = " ".join(f"{v[0]:,.0f}" for v in runs)
            print(
                f"| {phase} | {b.name} | {_median(runs, 0):,.0f} | {each} | "
                f"{_median(runs, 1):,.1f} |"
            )
            out[f"{phase}_{b.key}"] = runs
        rate = _median(getattr(on, phase), 0) / _median(getattr(off, phase), 0)
        cpu = _median(getattr(on, phase), 1) / _median(getattr(off, phase), 1)
        print(f"| {phase} | {on.key} / {off.key} | {rate:.3f} | | {cpu:.3f} |")
        out[f"{phase}_ratio"] = {"throughput": rate, "broker_cpu": cpu}
    return out


async def rounds(off: Broker, on: Broker, args: argparse.Namespace) -> None:
    for r in range(args.rounds):
        order = (off, on) if r % 2 == 0 else (on, off)
        for broker in order:
            await _round(broker, r, args)
        print(
            f"round {r + 1}: produce {off.key} {off.produce[-1][0]:,.0f} {on.key} "
            f"{on.produce[-1][0]:,.0f} msg/s; consume {off.key} {off.consume[-1][0]:,.0f} "
            f"{on.key} {on.consume[-1][0]:,.0f} msg/s",
            flush=True,
        )


def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="txmq-metrics-bench-"))
    off = Broker("A (off)" if args.aa else "off", 0, tmp)
    on = Broker("B (off)" if args.aa else "on", 0 if args.aa else free_port(), tmp)
    try:
        off.start()
        on.start()
        asyncio.run(rounds(off, on, args))
        result = report(off, on, args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    finally:
        off.stop()
        on.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=20_000, help="messages per phase")
    p.add_argument("--size", type=int, default=1024, help="message body size in bytes")
    p.add_argument("--window", type=int, default=128, help="max unacknowledged sends")
    p.add_argument("--rounds", type=int, default=5, help="rounds (each runs both brokers)")
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument(
        "--aa",
        action="store_true",
        help="metrics off on both brokers (an A/A run: how far apart two equal brokers measure)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
