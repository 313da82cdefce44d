"""txmq as a benchmark system: a real broker process, the async Producer and PushConsumer."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from typing import Any

from bench.common import LatencyCollector, Node, expected_messages, run_paced, run_windowed
from txmq import Message, Producer, PushConsumer
from txmq.protocol.message import MessageExt

TOPIC = "bench"
QUEUES = 4


class TxmqSystem:
    def __init__(self, flush: str, *, pull_batch: int = 64) -> None:
        self.key = f"txmq-{flush}"
        self.flush = flush
        self.name = f"txmq ({flush} flush)"
        self.durability = (
            "fsync (group commit) before ack"
            if flush == "sync"
            else "page cache, fsync every 500 ms"
        )
        self.pull_batch = pull_batch
        self._tmp: str | None = None
        self._node: Node | None = None
        self.address = ""
        self.producer: Producer | None = None

    async def setup(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="txmq-bench-")
        argv = ["broker", "start", "--store", f"{self._tmp}/store", "--flush", self.flush]
        self._node = Node("txmq-broker", argv, self._tmp, timeout=30).start()
        self.address = await self._node.wait_ready_async()
        self.producer = Producer(self.address, "bench-producer")
        await self.producer.start()
        from txmq import AdminClient

        async with AdminClient(self.address) as admin:
            await admin.create_topic(TOPIC, QUEUES)

    async def produce(self, n: int, body: bytes, window: int) -> float:
        producer = self.producer
        assert producer is not None
        msg = Message(TOPIC, body)

        async def send_one(i: int) -> None:
            await producer.send(msg)

        return await run_windowed(n, window, send_one)

    async def _run_push(self, group: str, listener: Any, from_first: bool) -> PushConsumer:
        consumer = PushConsumer(
            self.address,
            group,
            listener=listener,
            consume_from="FIRST_OFFSET" if from_first else "LAST_OFFSET",
            pull_batch_size=self.pull_batch,
        )
        consumer.subscribe(TOPIC)
        await consumer.start()
        return consumer

    async def consume(self, n: int) -> float:
        """A PushConsumer (concurrent listener, offsets committed as it goes) drains the topic."""
        done = asyncio.Event()
        count = 0

        async def listener(msg: MessageExt) -> None:
            nonlocal count
            count += 1
            if count >= n:
                done.set()

        t0 = time.perf_counter()
        consumer = await self._run_push("bench-consume", listener, from_first=True)
        try:
            await done.wait()
            await consumer.offsets.persist(set(consumer.queues_held))
            return time.perf_counter() - t0
        finally:
            await consumer.stop()

    async def latency(self, rate: int, duration: float, body_size: int) -> list[float]:
        producer = self.producer
        assert producer is not None
        collector = LatencyCollector(expected_messages(rate, duration))

        async def listener(msg: MessageExt) -> None:
            collector.record(msg.body)

        consumer = await self._run_push("bench-latency", listener, from_first=False)

        async def send(body: bytes) -> None:
            await producer.send(Message(TOPIC, body))

        try:
            await run_paced(rate, duration, body_size, send)
            return await collector.wait(10)
        finally:
            await consumer.stop()

    async def teardown(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
        if self._node is not None:
            await self._node.stop_async()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def make_systems(args: argparse.Namespace) -> list[TxmqSystem]:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return [TxmqSystem("async"), TxmqSystem("sync")]
