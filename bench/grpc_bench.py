"""Produce and receive throughput through txmq's gRPC endpoint (RocketMQ 5's protocol) with
the official RocketMQ 5 Python client, next to txmq's own client on txmq's protocol (and on
the gRPC transport, when this txmq has it), in one run on one broker process.

    .venv/bin/python bench/grpc_bench.py --messages 20000 --size 1024

Each system gets a topic of its own (4 queues) on the same broker (``--grpc-port`` free,
async flush).  Produce: ``--messages`` sends of ``--size`` bytes with at most ``--window``
unacknowledged (the official client: ``send_async`` futures; txmq: concurrent ``send``).
Receive: the official SimpleConsumer (batches of 32, each message acked by a pool of 16
threads) or txmq's PushConsumer drains what was produced.  Numbers are messages per
second; the table also shows the broker's and the client's CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Node, free_port, machine_info, payload, run_windowed

QUEUES = 4


@dataclass
class Row:
    system: str
    produce_s: float
    consume_s: float
    messages: int
    broker_cpu_s: float
    client_cpu_s: float

    def line(self) -> str:
        p = self.messages / self.produce_s
        c = self.messages / self.consume_s
        return (
            f"{self.system:<44} {p:>10,.0f} {c:>10,.0f} "
            f"{self.broker_cpu_s:>9.1f} {self.client_cpu_s:>9.1f}"
        )


class Broker:
    """One broker (async flush) with a gRPC endpoint on a free port, in a temporary folder."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="txmq-grpc-bench-"))
        self.grpc_port = free_port()
        argv = ["broker", "start", "--store", str(self.tmp / "store")]
        self.node = Node("broker", argv, self.tmp, extra=["--grpc-port", str(self.grpc_port)])
        try:
            self.address = self.node.start().wait_ready(30)
        except BaseException:
            self.stop()
            raise
        self.endpoint = f"127.0.0.1:{self.grpc_port}"

    def cpu(self) -> float:
        return self.node.cpu()

    def stop(self) -> None:
        self.node.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _create_topic(broker: Broker, topic: str) -> None:
    from txmq import AdminClient

    async with AdminClient(broker.address) as admin:
        await admin.create_topic(topic, QUEUES)


# -- the official client --------------------------------------------------------------------


async def official(broker: Broker, n: int, body: bytes, window: int) -> tuple[float, float]:
    from rocketmq.v5.client import ClientConfiguration, Credentials
    from rocketmq.v5.consumer import SimpleConsumer
    from rocketmq.v5.model import FilterExpression, Message
    from rocketmq.v5.producer import Producer

    topic = "bench-official"
    await _create_topic(broker, topic)
    cfg = ClientConfiguration(broker.endpoint, Credentials(), request_timeout=10)
    producer = Producer(cfg, (topic,))
    await asyncio.to_thread(producer.startup)

    async def send_one(i: int) -> None:
        m = Message()
        m.topic = topic
        m.body = body
        await asyncio.wrap_future(producer.send_async(m))

    try:
        produce_s = await run_windowed(n, window, send_one)
    finally:
        await asyncio.to_thread(producer.shutdown)

    sub = {topic: FilterExpression("*")}
    consumer = SimpleConsumer(cfg, "bench-official", sub, await_duration=5)
    await asyncio.to_thread(consumer.startup)

    def drain() -> float:
        # the client's ack_async needs an event loop in the calling thread: acks go to a
        # pool of threads instead, as an application's workers would ack
        pool = concurrent.futures.ThreadPoolExecutor(16)
        acks: list[concurrent.futures.Future[Any]] = []
        got = 0
        t0 = time.perf_counter()
        deadline = time.monotonic() + 600
        while got < n and time.monotonic() < deadline:
            for m in consumer.receive(32, 60):
                acks.append(pool.submit(consumer.ack, m))
                got += 1
            if len(acks) > window:
                for f in acks:
                    f.result()
                acks.clear()
        for f in acks:
            f.result()
        pool.shutdown()
        if got < n:
            raise RuntimeError(f"the official SimpleConsumer received {got} of {n}")
        return time.perf_counter() - t0

    try:
        consume_s = await asyncio.to_thread(drain)
    finally:
        await asyncio.to_thread(consumer.shutdown)
    return produce_s, consume_s


# -- txmq's own client ----------------------------------------------------------------------


async def txmq_client(
    broker: Broker, n: int, body: bytes, window: int, transport: str
) -> tuple[float, float]:
    from txmq import Message, Producer, PushConsumer

    topic = f"bench-txmq-{transport}"
    await _create_topic(broker, topic)
    address = broker.address if transport == "txmq" else broker.endpoint
    kw: dict[str, Any] = {} if transport == "txmq" else {"transport": transport}
    producer = Producer(address, "bench-producer", **kw)
    await producer.start()
    msg = Message(topic, body)

    async def send_one(i: int) -> None:
        await producer.send(msg)

    try:
        produce_s = await run_windowed(n, window, send_one)
    finally:
        await producer.stop()
    done = asyncio.Event()
    count = 0
    lock = threading.Lock()

    async def listener(m: Any) -> None:
        nonlocal count
        with lock:
            count += 1
            if count >= n:
                done.set()

    consumer = PushConsumer(
        address, "bench-consume", listener=listener, consume_from="FIRST_OFFSET", **kw
    )
    consumer.subscribe(topic)
    t0 = time.perf_counter()
    await consumer.start()
    try:
        await asyncio.wait_for(done.wait(), 600)
        return produce_s, time.perf_counter() - t0
    finally:
        await consumer.stop()


def _has_grpc_transport() -> bool:
    import inspect

    from txmq.client.core import BrokerClient

    return "transport" in inspect.signature(BrokerClient.__init__).parameters


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    args = ap.parse_args()
    body = payload(args.size)
    broker = Broker()
    systems: list[tuple[str, Callable[[], Awaitable[tuple[float, float]]]]] = [
        (
            "official rocketmq-python-client -> gRPC",
            lambda: official(broker, args.messages, body, args.window),
        ),
        (
            "txmq client -> txmq protocol",
            lambda: txmq_client(broker, args.messages, body, args.window, "txmq"),
        ),
    ]
    if _has_grpc_transport():
        systems.append(
            (
                "txmq client -> gRPC transport",
                lambda: txmq_client(broker, args.messages, body, args.window, "grpc"),
            )
        )
    rows = []
    try:
        for name, run in systems:
            b0, c0 = broker.cpu(), _own_cpu()
            produce_s, consume_s = await run()
            rows.append(
                Row(name, produce_s, consume_s, args.messages, broker.cpu() - b0, _own_cpu() - c0)
            )
    finally:
        broker.stop()
    info = machine_info()
    print(f"# {args.messages} messages of {args.size} B, window {args.window}, one broker "
          f"(async flush); {info.get('nproc')} CPUs, Python {info.get('python')}")  # fmt: skip
    print(f"{'system':<44} {'produce/s':>10} {'receive/s':>10} {'broker s':>9} {'client s':>9}")
    for row in rows:
        print(row.line())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(main())
