"""The proxy's client of the cluster: txmq's client core (routes from the name servers,
latency fault avoidance, one connection per broker set's master, auto-created topics,
heartbeats) with what the gRPC endpoint asks of a :class:`~txmq.server.grpc.ports.BrokerCore`
— sends that pick their queue and retry elsewhere, transactions ended on the broker set
that holds the half, consumer groups' configs — and the check-backs brokers send it.

It heartbeats every broker set's master as a producer of the groups its gRPC producers
publish (:mod:`txmq.proxy.producers`), at once when a group gets its first producer and
every ``heartbeat_interval_s``; a group that lost its last producer is unregistered.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections import Counter
from typing import Any

import anyio
import msgspec

from txmq.client.core import BrokerClient
from txmq.protocol.message import MessageQueue, Prop, stable_hash
from txmq.protocol.rpc import Call
from txmq.protocol.wire import (
    MASTER_ID,
    CheckTransactionState,
    Ended,
    EndTransaction,
    GetClusterInfo,
    GetSubscriptionGroup,
    Heartbeat,
    Request,
    SendEntry,
    SendMessage,
    SendMessages,
    Sent,
    UnregisterClient,
)
from txmq.protocol.wire.base import Response
from txmq.protocol.wire.errors import (
    BrokerUnavailable,
    ServerError,
    TransactionNotFound,
    TxmqError,
    error_for_code,
)
from txmq.proxy.batching import Batches
from txmq.proxy.config import ProxyConfig
from txmq.proxy.producers import ProxyProducers
from txmq.server.grpc.ports import ASKED, QueueSet, Stored
from txmq.transports.port import Calls

__all__ = ["ClusterLink"]

log = logging.getLogger("txmq.proxy")

#: a send without a message group is tried on this many queues (RocketMQ: 1 + 2 retries)
SEND_ATTEMPTS = 3
#: how long a consumer group's config is reused (RocketMQ's proxy caches it too)
GROUP_CONFIG_TTL_S = 5.0
#: a send a broker answered neither stored nor failed (a broker of another version)
_LOST = ServerError("the broker did not say what became of the message")


class ClusterLink(BrokerClient):
    heartbeat_every_master = True

    def __init__(self, config: ProxyConfig) -> None:
        super().__init__(
            namesrv=config.namesrv_addresses,
            transport="txmq",
            request_timeout=config.request_timeout_s,
            connect_timeout=min(config.request_timeout_s, 3.0),
            route_ttl=config.route_ttl_s,
            security=config.peer_security(),
        )
        self.heartbeat_interval = config.heartbeat_interval_s
        #: how long a batch to a broker set with one out waits for company
        self.batch_linger_s = config.batch_linger_ms / 1000
        self.client_id = f"proxy@{socket.gethostname()}@{os.getpid()}"
        #: the endpoint's producer registry: who gets the brokers' check-backs
        self.producers = ProxyProducers(self._producers_changed)
        self._turns = itertools.count()
        #: sends to a broker set that come in one turn of the event loop go as one request
        self.sends: Batches[tuple[str, str], tuple[SendMessage, bytes], Sent] = Batches(
            self._send_batch,
            linger_s=self.batch_linger_s,
            max_bytes=config.max_frame_size // 2,
            size=lambda item: len(item[1]),
        )
        self._group_configs: dict[str, tuple[float, tuple[bool, int]]] = {}

    # -- lifecycle and heartbeats -----------------------------------------------------------

    async def _on_start(self) -> None:
        try:  # a name server that is not up yet is asked again at each request
            await self.connect()
        except BrokerUnavailable as exc:
            log.warning("proxy: %s (asked again at each request)", exc)
        self._task_group().start_soon(self._heartbeat_loop)

    def _heartbeat_request(self) -> Heartbeat | None:
        groups = self.producers.groups()
        return Heartbeat(client_id=self.client_id, producers=groups) if groups else None

    def _producers_changed(self, group: str, joined: bool) -> None:
        if not self.started:
            return
        try:
            tg = self._task_group()
        except BrokerUnavailable:
            return
        if joined:
            tg.start_soon(self._heartbeat)
        else:
            leave = UnregisterClient(client_id=self.client_id, producer_groups=[group])
            tg.start_soon(self._unregister, leave)

    async def _on_stop(self) -> None:
        groups = self.producers.groups()
        if groups:
            with anyio.move_on_after(3):
                leave = UnregisterClient(client_id=self.client_id, producer_groups=groups)
                await self._unregister(leave)

    def serve(self, request: Request[Any], body: bytes, origin: Calls) -> Response | None:
        """A broker's check-back goes to a gRPC producer of its group."""
        if isinstance(request, CheckTransactionState):
            self.producers.check_back(request, body)
            return None
        return super().serve(request, body, origin)

    # -- routes -----------------------------------------------------------------------------

    async def queue_sets(self, topic: str, create: bool) -> list[QueueSet]:
        """The topic's broker sets, each at the proxy the client asked (RocketMQ's proxy in
        cluster mode): the endpoint's RouteSource."""
        route = await self.route(topic, create=create)
        write = Counter(mq.broker_name for mq in route.write_queues)
        read = Counter(mq.broker_name for mq in route.read_queues)
        return [
            QueueSet(
                broker_name=name,
                address=ASKED,
                queue_nums=max(write[name], read[name]),
                readable=name in read,
                writable=name in write,
            )
            for name in sorted(set(write) | set(read))
        ]

    # -- sending ----------------------------------------------------------------------------

    async def send(self, req: SendMessage, body: bytes, user: str | None = None) -> Stored:
        """Store a message on a broker set of its topic: by its message group (the same
        queue as txmq's producers pick for that sharding key), else round robin past the
        broker sets left out, retrying a retriable failure on another set."""
        route = await self.routes.writable(req.topic, self.request_timeout, create=True)
        key = req.properties.get(Prop.SHARDING_KEY)
        if key:
            queues = route.write_queues
            mq, attempts = queues[stable_hash(key) % len(queues)], 1
        else:
            mq, attempts = self.routes.pick(route, next(self._turns)), SEND_ATTEMPTS
        for attempt in range(attempts):
            try:
                return mq.broker_name, await self._send_to(mq, req, body)
            except TxmqError as exc:
                if not exc.retriable or attempt + 1 >= attempts:
                    raise
                log.warning("send to %s failed (%s); retrying on another queue", mq, exc)
                route = await self.routes.writable(
                    req.topic, self.request_timeout, create=True, refresh=True
                )
                mq = self.routes.pick(route, next(self._turns), avoid=mq.broker_name)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _send_to(self, mq: MessageQueue, req: SendMessage, body: bytes) -> Sent:
        """Send to the queue's master (with the sends to that set in the same turn),
        recording how long it took (or that it failed) for fault avoidance."""
        request = msgspec.structs.replace(req, queue_id=mq.queue_id)
        began = time.monotonic()
        try:
            sent = await self.sends.submit((mq.broker_name, req.topic), (request, body))
        except TxmqError as exc:
            if exc.retriable:
                took = (time.monotonic() - began) * 1000
                self.routes.faults.update(mq.broker_name, took, failed=True)
                self.routes.failed(mq, unreachable=not getattr(exc, "sent", True))
            raise
        self.routes.faults.update(mq.broker_name, (time.monotonic() - began) * 1000)
        return sent

    async def _send_batch(
        self, key: tuple[str, str], items: list[tuple[SendMessage, bytes]]
    ) -> list[Sent | BaseException]:
        """One SEND_MESSAGES for the sends of a turn to one topic on one broker set."""
        broker, topic = key
        if len(items) == 1:  # as itself: no batch to unpack
            request, body = items[0]
            return [await self.call(request, body, broker=broker)]
        entries = [
            SendEntry(
                size=len(body),
                queue_id=r.queue_id,
                properties=r.properties,
                born_timestamp=r.born_timestamp,
                flag=r.flag,
                group=r.group,
            )
            for r, body in items
        ]
        bodies = b"".join(body for _, body in items)
        answer = await self.call(SendMessages(topic=topic, messages=entries), bodies, broker=broker)
        out: list[Sent | BaseException] = [s if s is not None else _LOST for s in answer.sent]
        for f in answer.failed:
            out[f.index] = error_for_code(f.code, f.error)
        return out

    # -- transactions -----------------------------------------------------------------------

    async def half_group(self, broker: str, offset: int, topic: str) -> str:
        """A RocketMQ 5 client's producer group is its topic (the broker checks that the
        half is that group's); the topic's route names the broker set's master."""
        if not broker:
            raise TransactionNotFound(
                "the transaction id names no broker set: it was not given by a txmq proxy"
            )
        if topic:
            await self.route(topic)
        return topic

    async def end_transaction(self, broker: str, req: EndTransaction, call: Call | None) -> Ended:
        return await self.call(req, broker=broker)

    # -- consumer groups --------------------------------------------------------------------

    async def group_policy(self, group: str) -> tuple[bool, int]:
        """(FIFO?, retry max times) of a consumer group, as a broker of the cluster has it
        (reused for a few seconds; the last one known while no broker answers)."""
        cached = self._group_configs.get(group)
        if cached is not None and time.monotonic() - cached[0] < GROUP_CONFIG_TTL_S:
            return cached[1]
        said: list[str] = []
        for address in await self._brokers():
            try:
                row = (
                    await self.routes.remote(address).call(
                        GetSubscriptionGroup(group=group), timeout=self.request_timeout
                    )
                ).header
            except TxmqError as exc:
                if not exc.retriable:
                    raise
                said.append(f"{address}: {exc}")
                continue
            policy = (row.fifo, row.retry_max_times)
            self._group_configs[group] = (time.monotonic(), policy)
            return policy
        if cached is not None:
            return cached[1]
        raise BrokerUnavailable(
            f"no broker told the config of consumer group {group!r}: "
            + ("; ".join(said) or "the name servers know no broker")
        )

    async def _brokers(self) -> list[str]:
        """Brokers to ask a group's config: the masters of the routes known, else of the
        whole cluster (any of them has every group's config)."""
        known = sorted(self.routes.known_addresses())
        if known:
            return known
        info = await self.routes.ask_namesrv(GetClusterInfo())
        return sorted({a for b in info.brokers if (a := b.addresses.get(MASTER_ID)) is not None})
