"""The demo's local cluster: its broker processes (nodes) and what the name server and the
controller inside it say about them.

The cluster layout: one name server with the controller inside
(``--controller-store``); broker set ``broker-a`` replicated — two nodes, ``broker-a-0``
and ``broker-a-1`` (``--broker-id 0`` / ``1``, SYNC replication), whose master the
controller elects (and replaces when it dies); broker set ``broker-b`` one broker alone.
Every node keeps its store, client port and HA port across restarts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from examples.orders.procs import Proc
from txmq.protocol.peer import RemotingClient
from txmq.protocol.wire import (
    MASTER_ID,
    BrokerSetState,
    GetClusterInfo,
    GetReplicaInfo,
    GetTopicRoute,
    Request,
)
from txmq.protocol.wire.base import R
from txmq.protocol.wire.errors import TopicNotFound
from txmq.security.client import client_security

__all__ = [
    "ALONE",
    "BROKER_SETS",
    "CLUSTER",
    "REPLICATED",
    "BrokerNode",
    "ask",
    "masters_registered",
    "node_names",
    "registered_id",
    "replica_state",
    "routed_sets",
    "set_healthy",
    "wait_set_healthy",
]

CLUSTER = "DemoCluster"
BROKER_SETS = ("broker-a", "broker-b")
REPLICATED = "broker-a"
"""The broker set of two replicas under the controller."""
ALONE = "broker-b"
"""The broker set of one broker (no replication)."""
REPLICAS = 2


@dataclass
class BrokerNode:
    """One broker process of the demo: its name, ports and store survive its restarts.
    ``broker_set``: the broker set it serves; ``broker_id``: its own id in a replicated set
    (None: a broker alone)."""

    name: str
    broker_set: str
    port: int
    ha_port: int
    store: Path
    broker_id: int | None = None
    proc: Proc | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive


def node_names(single: bool) -> list[tuple[str, str, int | None]]:
    """(node name, broker set, own id in a replicated set) of every broker of a layout."""
    if single:
        return [("broker", "broker-a", None)]
    nodes: list[tuple[str, str, int | None]] = []
    for name in BROKER_SETS:
        if name == REPLICATED:
            nodes += [(f"{name}-{i}", name, i) for i in range(REPLICAS)]
        else:
            nodes.append((name, name, None))
    return nodes


def ask(address: str, request: Request[R], timeout: float = 5.0) -> R:
    """One request to a name server (or a broker), on a connection of its own."""

    async def go() -> R:
        # the demo's credentials and TLS (--secure) come from the environment
        security = client_security()
        async with RemotingClient(address, connect_timeout=timeout, security=security) as client:
            return (await client.call(request, timeout=timeout)).header

    return anyio.run(go)


def routed_sets(namesrv: str, topic: str) -> int:
    """How many broker sets the name server routes ``topic`` to."""
    try:
        return len(ask(namesrv, GetTopicRoute(topic=topic)).queues)
    except TopicNotFound:
        return 0


def masters_registered(namesrv: str) -> set[str]:
    """The broker sets that have a master registered with the name server."""
    info = ask(namesrv, GetClusterInfo())
    return {b.broker_name for b in info.brokers if b.addresses.get(MASTER_ID)}


def registered_id(namesrv: str, broker_set: str, address: str) -> int | None:
    """The broker id ``address`` is registered under in ``broker_set`` (None: it is not)."""
    for b in ask(namesrv, GetClusterInfo()).brokers:
        if b.broker_name == broker_set:
            for broker_id, registered in b.addresses.items():
                if registered == address:
                    return int(broker_id)
    return None


def replica_state(namesrv: str, broker_set: str) -> BrokerSetState | None:
    """The controller's view of ``broker_set`` (epoch, master, in-sync set, replicas)."""
    info = ask(namesrv, GetReplicaInfo(broker_name=broker_set))
    return info.sets[0] if info.sets else None


def set_healthy(namesrv: str, nodes: list[BrokerNode]) -> BrokerSetState | None:
    """The set's state once a master leads every other live replica in its sync state set
    and is registered with the name server as the master; else None."""
    s = replica_state(namesrv, nodes[0].broker_set)
    if s is None or s.electing or s.master_id < 0:
        return None
    alive = {r.broker_id for r in s.replicas if r.alive}
    acting = {r.broker_id for r in s.replicas if r.master and r.alive}
    others = {n.broker_id for n in nodes if n.alive and n.broker_id != s.master_id}
    if acting != {s.master_id} or not others | {s.master_id} <= alive:
        return None  # elected but not told yet, or a live node not seen by the controller
    if not others <= set(s.in_sync):
        return None
    if nodes[0].broker_set not in masters_registered(namesrv):
        return None
    return s


def wait_set_healthy(namesrv: str, nodes: list[BrokerNode], timeout: float) -> BrokerSetState:
    """Until :func:`set_healthy`; its state (raises after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        s = set_healthy(namesrv, nodes)
        if s is not None:
            return s
        if time.monotonic() > deadline:
            now = replica_state(namesrv, nodes[0].broker_set)
            raise RuntimeError(
                f"broker set {nodes[0].broker_set} is not whole within {timeout:.0f} s "
                f"(the controller says: {now})"
            )
        time.sleep(0.1)
