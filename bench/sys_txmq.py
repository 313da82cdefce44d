"""txmq as a benchmark system: a real broker process, the async Producer and PullConsumer."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import LatencyCollector, expected_messages, run_paced, run_windowed
from txmq import Message, Producer, PullConsumer, PullStatus

ROOT = Path(__file__).resolve().parent.parent
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
        self._proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.producer: Producer | None = None
        self.consumer: PullConsumer | None = None
        self._offsets = dict.fromkeys(range(QUEUES), 0)

    async def setup(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="txmq-bench-")
        ready = Path(self._tmp) / "ready"
        self._proc = _spawn_broker(self._tmp, self.flush, ready)
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text()):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("txmq broker did not start")
            await asyncio.sleep(0.05)
        self.address = ready.read_text()
        self.producer = Producer(self.address, "bench-producer")
        await self.producer.start()
        self.consumer = PullConsumer(self.address, "bench-consumer")
        await self.consumer.start()
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

    async def _drain(self, queue_id: int, want: int, sink: list[int]) -> None:
        consumer = self.consumer
        assert consumer is not None
        offset = self._offsets[queue_id]
        while sum(sink) < want:
            res = await consumer.pull(
                TOPIC, queue_id, offset, max_msgs=self.pull_batch, long_poll=1
            )
            if res.status == PullStatus.FOUND:
                sink[queue_id] += len(res.messages)
                offset = res.next_offset
                await consumer.commit_offset(TOPIC, queue_id, offset)
            elif res.status == PullStatus.OFFSET_ILLEGAL:
                offset = res.next_offset
        self._offsets[queue_id] = offset

    async def consume(self, n: int) -> float:
        sink = [0] * QUEUES
        t0 = time.perf_counter()
        await asyncio.gather(*(self._drain(q, n, sink) for q in range(QUEUES)))
        return time.perf_counter() - t0

    async def latency(self, rate: int, duration: float, body_size: int) -> list[float]:
        consumer, producer = self.consumer, self.producer
        assert consumer is not None and producer is not None
        collector = LatencyCollector(expected_messages(rate, duration))
        stop = asyncio.Event()

        async def listen(queue_id: int) -> None:
            offset = await consumer.max_offset(TOPIC, queue_id)
            while not stop.is_set():
                res = await consumer.pull(
                    TOPIC, queue_id, offset, max_msgs=self.pull_batch, long_poll=2
                )
                if res.status == PullStatus.FOUND:
                    for m in res.messages:
                        collector.record(m.body)
                    offset = res.next_offset

        listeners = [asyncio.create_task(listen(q)) for q in range(QUEUES)]
        await asyncio.sleep(0.2)  # let every listener park its long poll first

        async def send(body: bytes) -> None:
            await producer.send(Message(TOPIC, body))

        try:
            await run_paced(rate, duration, body_size, send)
            return await collector.wait(10)
        finally:
            stop.set()
            await asyncio.gather(*listeners, return_exceptions=True)

    async def teardown(self) -> None:
        for client in (self.producer, self.consumer):
            if client is not None:
                await client.stop()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self._proc.wait, 30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _spawn_broker(tmp: str, flush: str, ready: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "txmq",
            "--log-level",
            "WARNING",
            "broker",
            "start",
            "--store",
            f"{tmp}/store",
            "--port",
            "0",
            "--flush",
            flush,
            "--ready-file",
            str(ready),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )


def make_systems(args: argparse.Namespace) -> list[TxmqSystem]:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return [TxmqSystem("async"), TxmqSystem("sync")]
