"""Client registration (heartbeats), consumer groups and orderly consumption's queue locks."""

from __future__ import annotations

from typing import Literal

import msgspec

from txmq.protocol.wire.base import Empty, Name, NameOrEmpty, Request, Response
from txmq.protocol.wire.codes import RequestCode

__all__ = [
    "ConsumerConnection",
    "ConsumerConnections",
    "ConsumerData",
    "ConsumerList",
    "GetConsumerConnectionList",
    "GetConsumerListByGroup",
    "Heartbeat",
    "LockBatchMq",
    "Locked",
    "NotifyConsumerIdsChanged",
    "QueueRef",
    "ResetConsumerClientOffset",
    "UnlockBatchMq",
    "UnregisterClient",
]

#: (topic, queue id)
QueueRef = tuple[str, int]


class ConsumerData(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A consumer group a client belongs to, and what it consumes."""

    group: Name
    message_model: Literal["CLUSTERING", "BROADCASTING"] = "CLUSTERING"
    consume_type: Literal["CONCURRENTLY", "ORDERLY"] = "CONCURRENTLY"
    #: topic -> subscription expression ("*", "tagA || tagB")
    subscriptions: dict[str, str] = {}


class Heartbeat(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    """Who a client is: the consumer groups and producer groups it is a member of."""

    CODE = RequestCode.HEARTBEAT
    client_id: NameOrEmpty = ""
    consumers: list[ConsumerData] = []
    producers: list[Name] = []


class UnregisterClient(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.UNREGISTER_CLIENT
    client_id: Name
    consumer_groups: list[Name] = []
    producer_groups: list[Name] = []


class ConsumerList(Response, frozen=True, kw_only=True, omit_defaults=True):
    client_ids: list[str]


class GetConsumerListByGroup(Request[ConsumerList], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.GET_CONSUMER_LIST_BY_GROUP
    group: Name


class ConsumerConnection(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A live member of a consumer group as the broker knows it from its heartbeats."""

    group: str
    client_id: str
    #: the member's connection, as the broker sees it ("host:port")
    address: str
    message_model: str = "CLUSTERING"
    consume_type: str = "CONCURRENTLY"
    #: topic -> subscription expression
    subscriptions: dict[str, str] = {}
    #: seconds since its last heartbeat
    heartbeat_age_s: float = 0.0
    #: the broker set that answered (filled by a client of name servers)
    broker_name: str = ""


class ConsumerConnections(Response, frozen=True, kw_only=True, omit_defaults=True):
    connections: list[ConsumerConnection]


class GetConsumerConnectionList(
    Request[ConsumerConnections], frozen=True, kw_only=True, omit_defaults=True
):
    """The live members of consumer group ``group`` (empty: of every group with one),
    each with its address, subscriptions, consume type and message model (RocketMQ's
    GET_CONSUMER_CONNECTION_LIST, mqadmin's ``consumerConnection``)."""

    CODE = RequestCode.GET_CONSUMER_CONNECTION_LIST
    group: NameOrEmpty = ""


class Locked(Response, frozen=True, kw_only=True, omit_defaults=True):
    """The queues the caller holds now."""

    locked: list[QueueRef]


class LockBatchMq(Request[Locked], frozen=True, kw_only=True, omit_defaults=True):
    """Lock (or renew) queues for orderly consumption."""

    CODE = RequestCode.LOCK_BATCH_MQ
    group: Name
    client_id: Name
    queues: list[QueueRef]


class UnlockBatchMq(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.UNLOCK_BATCH_MQ
    group: Name
    client_id: Name
    queues: list[QueueRef]


class NotifyConsumerIdsChanged(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    """Broker to consumer (oneway): the members of ``group`` changed; rebalance now."""

    CODE = RequestCode.NOTIFY_CONSUMER_IDS_CHANGED
    group: str


class ResetConsumerClientOffset(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    """Broker to consumer (oneway): the broker reset ``group``'s offsets of ``topic`` on
    broker set ``broker_name`` (queue id -> offset): drop what was pulled from those
    queues and consume them from there."""

    CODE = RequestCode.RESET_CONSUMER_CLIENT_OFFSET
    group: str
    topic: str
    broker_name: str
    offsets: dict[int, int]
