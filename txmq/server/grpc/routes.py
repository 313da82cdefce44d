"""Routes of a broker's own endpoint: a broker alone answers with its own queues; a broker
of a cluster answers with every broker set's queues the name servers know, each set at its
master's gRPC endpoint, so a client given any one broker's endpoint sends to and receives
from the whole cluster.  (A proxy answers every set at itself: ``txmq/proxy/``.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from txmq.protocol.peer import RemotingClient
from txmq.protocol.wire import MASTER_ID, GetTopicRoute, TopicRoute
from txmq.protocol.wire.errors import BrokerUnavailable, TopicNotFound, TxmqError
from txmq.protocol.wire.route import PERM_READ, PERM_WRITE
from txmq.security.client import ClientSecurity
from txmq.server.grpc.ports import QueueSet

__all__ = ["QueueSet", "Routes"]

log = logging.getLogger("txmq.grpc")

#: how long a cluster route is reused (clients ask every 30 s, each for each topic)
ROUTE_CACHE_S = 2.0
CONNECT_TIMEOUT_S = 1.0
REQUEST_TIMEOUT_S = 3.0


class Routes:
    """A broker's :class:`~txmq.server.grpc.ports.RouteSource`: its own queue sets are at
    its own endpoint (address "")."""

    def __init__(
        self,
        *,
        broker_name: str,
        namesrv: tuple[str, ...],
        queue_count: Callable[[str, bool], int],
        security: ClientSecurity | None = None,
    ) -> None:
        """``queue_count(topic, create)``: the broker's queues of a topic (``create``:
        auto-create it if the broker does), else TopicNotFound; ``security``: how to reach
        the name servers (the broker's peer_security())."""
        self.broker_name = broker_name
        self.security = security
        self.namesrv = namesrv
        self._queue_count = queue_count
        self._cache: dict[str, tuple[float, list[QueueSet]]] = {}

    async def route(self, topic: str, create: bool) -> list[QueueSet]:
        """The topic's queue sets; TopicNotFound if none (and this broker does not create
        it)."""
        if not self.namesrv:
            return [self._own(topic, create)]
        cached = self._cache.get(topic)
        if cached is not None and time.monotonic() - cached[0] < ROUTE_CACHE_S:
            return cached[1]
        route = await self._ask(topic)
        sets = self._sets(route) if route is not None else []
        if not any(s.broker_name == self.broker_name for s in sets):
            # a topic the name servers do not know yet (created here a moment ago, or to be
            # created now) is served by this broker until its next registration
            try:
                sets.append(self._own(topic, create))
            except TopicNotFound:
                if not sets:
                    raise
        self._cache[topic] = (time.monotonic(), sets)
        return sets

    def _own(self, topic: str, create: bool) -> QueueSet:
        return QueueSet(self.broker_name, "", self._queue_count(topic, create))

    async def _ask(self, topic: str) -> TopicRoute | None:
        said: list[str] = []
        for address in self.namesrv:
            try:
                ask = GetTopicRoute(topic=topic)
                async with RemotingClient(
                    address, connect_timeout=CONNECT_TIMEOUT_S, security=self.security
                ) as client:
                    return (await client.call(ask, timeout=REQUEST_TIMEOUT_S)).header
            except TopicNotFound:
                return None
            except TxmqError as exc:
                said.append(f"{address}: {exc}")
        raise BrokerUnavailable("no name server answered the route: " + "; ".join(said))

    def _sets(self, route: TopicRoute) -> list[QueueSet]:
        endpoints = {b.broker_name: b.grpc_addresses.get(MASTER_ID, "") for b in route.brokers}
        sets = []
        for q in route.queues:
            own = q.broker_name == self.broker_name
            address = "" if own else endpoints.get(q.broker_name, "")
            if not address and not own:
                log.debug("broker set %s serves no gRPC endpoint: left out", q.broker_name)
                continue
            sets.append(
                QueueSet(
                    broker_name=q.broker_name,
                    address=address,
                    queue_nums=max(q.read_queue_nums, q.write_queue_nums),
                    readable=bool(q.perm & PERM_READ),
                    writable=bool(q.perm & PERM_WRITE),
                )
            )
        return sets
