"""Routes: which broker sets hold a topic's queues, and at which addresses.

One request, :class:`GetTopicRoute`, answers the same shape from a name server (the
cluster's route table) and from a broker running alone (itself as the only broker set), so
that every client has one routing core.  Brokers keep name servers' tables current with
:class:`RegisterBroker` (on start, every 30 s, when a topic changes) and
:class:`UnregisterBroker` (on a clean stop).  RocketMQ's codes and shapes: ``QueueData``,
``BrokerData``, ``TopicRouteData``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from txmq.protocol.wire.base import Empty, Name, Request, Response, Topic
from txmq.protocol.wire.codes import RequestCode

__all__ = [
    "MASTER_ID",
    "PERM_READ",
    "PERM_WRITE",
    "BrokerData",
    "ClusterInfo",
    "GetClusterInfo",
    "GetTopicRoute",
    "QueueData",
    "RegisterBroker",
    "Registered",
    "TopicConfigData",
    "TopicRoute",
    "UnregisterBroker",
]

#: the broker id of a broker set's master (slaves have ids above it)
MASTER_ID = 0
#: a broker set's queues of a topic may be read (consumed) / written (sent to)
PERM_READ = 4
PERM_WRITE = 2
#: a queue count on the wire: at least 0 (a topic may be read-only on a broker set)
QueueCount = Annotated[int, msgspec.Meta(ge=0, le=1024)]
Perm = Annotated[int, msgspec.Meta(ge=0, le=7)]
BrokerId = Annotated[int, msgspec.Meta(ge=0, le=1024)]
#: HOST:PORT
Address = Annotated[str, msgspec.Meta(min_length=3, max_length=300)]


class QueueData(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One broker set's queues of a topic."""

    broker_name: Name
    read_queue_nums: QueueCount
    write_queue_nums: QueueCount
    perm: Perm = PERM_READ | PERM_WRITE


class BrokerData(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A broker set: its cluster, its name, its brokers' addresses by broker id (0: master)."""

    cluster: Name
    broker_name: Name
    addresses: dict[BrokerId, Address]
    #: the RocketMQ 5 gRPC endpoints of those brokers that serve one
    grpc_addresses: dict[BrokerId, Address] = {}


class TopicRoute(Response, frozen=True, kw_only=True, omit_defaults=True):
    topic: str
    queues: list[QueueData]
    brokers: list[BrokerData]


class GetTopicRoute(Request[TopicRoute], frozen=True, kw_only=True, omit_defaults=True):
    """A topic's route.  A broker answers for itself (``create``: create the topic first if
    auto-creation is on); a name server answers from its table (TOPIC_NOT_EXIST if no
    broker registered the topic)."""

    CODE = RequestCode.GET_ROUTE_INFO
    topic: Topic
    create: bool = False


class TopicConfigData(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A topic as a broker registers it."""

    name: Topic
    read_queue_nums: QueueCount
    write_queue_nums: QueueCount
    perm: Perm = PERM_READ | PERM_WRITE


class Registered(Response, frozen=True, kw_only=True, omit_defaults=True):
    """What a name server tells a registering broker (for replication: its master)."""

    master_address: str = ""
    ha_address: str = ""


class RegisterBroker(Request[Registered], frozen=True, kw_only=True, omit_defaults=True):
    """A broker's registration: who it is, where, and every topic it holds.
    ``data_version`` grows when its topics change, so a name server can skip an unchanged
    table (the registration still counts as a heartbeat)."""

    CODE = RequestCode.REGISTER_BROKER
    cluster: Name
    broker_name: Name
    broker_id: BrokerId = MASTER_ID
    address: Address
    ha_address: str = ""
    #: where this broker serves RocketMQ 5's gRPC protocol ("" : it does not)
    grpc_address: str = ""
    data_version: int = 0
    topics: list[TopicConfigData] = []
    #: the broker set's epoch as this broker knows it (a master elected later has a higher
    #: one, and takes the place of a live broker registered under the same id)
    epoch: int = 0


class UnregisterBroker(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.UNREGISTER_BROKER
    cluster: Name
    broker_name: Name
    broker_id: BrokerId = MASTER_ID
    address: Address


class ClusterInfo(Response, frozen=True, kw_only=True, omit_defaults=True):
    """Every broker set the name server knows, and the broker names of each cluster."""

    brokers: list[BrokerData]
    clusters: dict[str, list[str]]


class GetClusterInfo(Request[ClusterInfo], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.GET_BROKER_CLUSTER_INFO
