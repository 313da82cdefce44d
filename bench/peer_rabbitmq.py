"""RabbitMQ peer: aio-pika, durable classic queue, persistent messages, publisher confirms.

* produce: one publisher channel in confirm mode; ``window`` publishes outstanding at once
  (each ``exchange.publish`` awaits its own basic.ack from the broker).
* consume: a separate connection/channel with prefetch ``PREFETCH``; every message is acked
  individually (``basic.ack`` per message, multiple=False); the phase ends after the last
  message is acked and a passive queue.declare round trip on the same channel returns (so
  the broker has processed all acks before the clock stops).
* latency: a consumer (own connection, prefetch ``PREFETCH``, ack per message) on the same
  queue, started before the producer; the producer publishes at a fixed rate with the
  send time in the body, confirms awaited in the background (at most ``window`` in flight).

Publisher and consumer use separate connections, as RabbitMQ recommends (flow control
blocks a publishing connection).
"""

from __future__ import annotations

import asyncio
import time

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from bench.common import LatencyCollector, expected_messages, run_paced, run_windowed

PREFETCH = 1000


class RabbitMQSystem:
    key = "rabbitmq"
    name = "rabbitmq (durable, confirms)"
    durability = "fsync (batched) before confirm"

    def __init__(
        self,
        url: str = "amqp://guest:guest@127.0.0.1:5672/",
        queue: str = "txmq-bench",
        window: int = 256,
        timeout: float = 60.0,
    ) -> None:
        self.url = url
        self.queue_name = queue
        self.window = window
        self.timeout = timeout
        self.version = ""
        self._pub_conn: AbstractConnection | None = None
        self._sub_conn: AbstractConnection | None = None
        self._pub_ch: AbstractChannel | None = None

    async def _connect(self) -> AbstractConnection:
        return await aio_pika.connect(self.url, client_properties={"connection_name": "txmq-bench"})

    async def setup(self) -> None:
        self._pub_conn = await self._connect()
        self._sub_conn = await self._connect()
        props = self._pub_conn.transport.connection.server_properties  # type: ignore[union-attr]
        server = props.get("version", b"?")
        server = server.decode() if isinstance(server, bytes) else str(server)
        self.version = f"RabbitMQ {server}, aio-pika {aio_pika.__version__}"
        self._pub_ch = await self._pub_conn.channel(publisher_confirms=True)
        await self._pub_ch.queue_delete(self.queue_name)
        await self._pub_ch.declare_queue(self.queue_name, durable=True)

    async def _publish(self, body: bytes) -> None:
        assert self._pub_ch is not None
        confirm = await self._pub_ch.default_exchange.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=self.queue_name,
        )
        if not isinstance(confirm, aiormq.spec.Basic.Ack):
            raise RuntimeError(f"rabbitmq: publish not acked: {confirm!r}")

    async def produce(self, n: int, body: bytes, window: int) -> float:
        return await run_windowed(n, window, lambda _i: self._publish(body))

    async def consume(self, n: int) -> float:
        assert self._sub_conn is not None
        ch = await self._sub_conn.channel()
        await ch.set_qos(prefetch_count=PREFETCH)
        queue = await ch.declare_queue(self.queue_name, durable=True, passive=True)
        done = asyncio.Event()
        received = 0

        async def on_message(msg: AbstractIncomingMessage) -> None:
            nonlocal received
            received += 1
            await msg.ack()
            if received >= n:
                done.set()

        t0 = time.perf_counter()
        tag = await queue.consume(on_message, no_ack=False)
        try:
            await asyncio.wait_for(done.wait(), self.timeout)
        except TimeoutError:
            raise TimeoutError(f"rabbitmq consume: {received}/{n} received") from None
        # Round trip on the consuming channel: the broker has processed every ack before it.
        left = await ch.declare_queue(self.queue_name, durable=True, passive=True)
        elapsed = time.perf_counter() - t0
        await queue.cancel(tag)
        ready = left.declaration_result.message_count
        await ch.close()
        if received != n or ready:
            raise RuntimeError(f"rabbitmq consume: received {received}/{n}, {ready} left ready")
        return elapsed

    async def latency(self, rate: int, duration: float, body_size: int) -> list[float]:
        assert self._sub_conn is not None
        ch = await self._sub_conn.channel()
        await ch.set_qos(prefetch_count=PREFETCH)
        queue = await ch.declare_queue(self.queue_name, durable=True, passive=True)
        collector = LatencyCollector(expected_messages(rate, duration))

        async def on_message(msg: AbstractIncomingMessage) -> None:
            collector.record(msg.body)
            await msg.ack()

        tag = await queue.consume(on_message, no_ack=False)
        try:
            await run_paced(rate, duration, body_size, self._publish, window=self.window)
            return await collector.wait(max(10.0, duration))
        finally:
            await queue.cancel(tag)
            await ch.close()

    async def teardown(self) -> None:
        try:
            if self._pub_ch is not None and not self._pub_ch.is_closed:
                await self._pub_ch.queue_delete(self.queue_name)
        finally:
            for conn in (self._pub_conn, self._sub_conn):
                if conn is not None:
                    await conn.close()
            self._pub_conn = self._sub_conn = self._pub_ch = None
