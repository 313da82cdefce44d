"""NATS JetStream peer: nats-py, one stream with file storage, deleted and recreated at setup.

* produce: ``js.publish`` (a request that returns the stream's PubAck); ``window`` publishes
  outstanding at once on the publisher connection.  Each publish's call-to-PubAck time is
  kept in ``publish_latencies_ms`` (bench/peer_nats_cluster.py reports it).
* consume: a durable pull consumer (explicit ack) on a separate connection; ``fetch`` in
  batches of ``FETCH_BATCH``, every message acked individually (``msg.ack()``, a
  fire-and-forget publish like basic.ack); the phase ends after the last ack and a
  PING/PONG round trip (``nc.flush()``) so the server has read all acks.
* latency: an ephemeral push consumer (explicit ack, ack per message) on its own subject,
  created before the producer starts; producer as in produce but paced at a fixed rate.

Stream retention is the default (limits): acked messages stay in the stream, like a
RocketMQ commit log.  Server-side durability is the nats-server default for file storage:
a PubAck means the message was written to the block file (OS page cache); the store is
fsynced in the background every 2 minutes unless ``sync_interval: always`` is configured
(it is not on this machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import nats
from nats.aio.client import Client as NATS
from nats.aio.client import __version__ as nats_py_version
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from bench.common import LatencyCollector, expected_messages, run_paced, run_windowed

FETCH_BATCH = 256
PREFETCH = 1000  # max_ack_pending, same as the RabbitMQ prefetch


class NatsSystem:
    key = "nats"
    name = "nats-jetstream (file)"
    durability = "page cache before PubAck, fsync every 2 min (server default)"

    def __init__(
        self,
        url: str | Sequence[str] = "nats://127.0.0.1:4222",
        stream: str = "TXMQBENCH",
        window: int = 256,
        timeout: float = 60.0,
        num_replicas: int = 1,
    ) -> None:
        # One URL, or the client URLs of a cluster (nats-py picks one of them at random).
        self.url = url if isinstance(url, str) else list(url)
        self.num_replicas = num_replicas
        self.stream = stream
        self.subject = f"{stream.lower()}.data"
        self.lat_subject = f"{stream.lower()}.lat"
        self.window = window
        self.timeout = timeout
        self.version = ""
        self._pub: NATS | None = None
        self._sub: NATS | None = None
        self._pub_js: JetStreamContext | None = None
        self._sub_js: JetStreamContext | None = None
        self.publish_latencies_ms: list[float] = []  # of the last produce(), in ms

    async def setup(self) -> None:
        self._pub = await nats.connect(self.url, name="txmq-bench-pub")
        self._sub = await nats.connect(self.url, name="txmq-bench-sub")
        self._pub_js = self._pub.jetstream(timeout=self.timeout)
        self._sub_js = self._sub.jetstream(timeout=self.timeout)
        sv = self._pub.connected_server_version
        self.version = f"nats-server {sv.major}.{sv.minor}.{sv.patch}, nats-py {nats_py_version}"
        with contextlib.suppress(NotFoundError):
            await self._pub_js.delete_stream(self.stream)
        await self._pub_js.add_stream(
            StreamConfig(
                name=self.stream,
                subjects=[f"{self.stream.lower()}.>"],
                storage=StorageType.FILE,
                num_replicas=self.num_replicas,
            )
        )

    async def _publish(self, subject: str, body: bytes) -> None:
        assert self._pub_js is not None
        # Raises on an error PubAck (APIError) or a timeout.
        await self._pub_js.publish(subject, body, timeout=self.timeout)

    async def produce(self, n: int, body: bytes, window: int) -> float:
        lat: list[float] = []
        self.publish_latencies_ms = lat

        async def send_one(_i: int) -> None:
            t0 = time.perf_counter_ns()
            await self._publish(self.subject, body)
            lat.append((time.perf_counter_ns() - t0) / 1e6)

        return await run_windowed(n, window, send_one)

    async def consume(self, n: int) -> float:
        assert self._sub is not None and self._sub_js is not None
        durable = "bench-consume"
        psub = await self._sub_js.pull_subscribe(
            self.subject,
            durable=durable,
            stream=self.stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=PREFETCH),
        )
        received = 0
        t0 = time.perf_counter()
        deadline = t0 + self.timeout
        try:
            while received < n:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"nats consume: {received}/{n} received")
                try:
                    msgs = await psub.fetch(min(FETCH_BATCH, n - received), timeout=5)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    await msg.ack()
                received += len(msgs)
            await self._sub.flush()
            elapsed = time.perf_counter() - t0
            info = await self._sub_js.consumer_info(self.stream, durable)
        finally:
            await psub.unsubscribe()
            with contextlib.suppress(Exception):
                await self._sub_js.delete_consumer(self.stream, durable)
        if received != n or info.num_pending:
            raise RuntimeError(
                f"nats consume: received {received}/{n}, {info.num_pending} still pending"
            )
        return elapsed

    async def latency(self, rate: int, duration: float, body_size: int) -> list[float]:
        assert self._sub_js is not None
        collector = LatencyCollector(expected_messages(rate, duration))

        async def on_msg(msg: Msg) -> None:
            collector.record(msg.data)
            await msg.ack()

        sub = await self._sub_js.subscribe(
            self.lat_subject,
            cb=on_msg,
            manual_ack=True,
            stream=self.stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.NEW,  # only what this run publishes
                max_ack_pending=PREFETCH,
            ),
        )
        try:
            await run_paced(
                rate,
                duration,
                body_size,
                lambda body: self._publish(self.lat_subject, body),
                window=self.window,
            )
            return await collector.wait(max(10.0, duration))
        finally:
            await sub.unsubscribe()

    async def teardown(self) -> None:
        try:
            if self._pub_js is not None:
                with contextlib.suppress(NotFoundError):
                    await self._pub_js.delete_stream(self.stream)
        finally:
            for nc in (self._pub, self._sub):
                if nc is not None and not nc.is_closed:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(nc.close(), 10)
            self._pub = self._sub = None
            self._pub_js = self._sub_js = None
