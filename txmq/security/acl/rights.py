"""What each request needs: for every request class, the rights its user must have.

A request's needs are a list; each need is satisfied by any one of its alternatives, a
(resource, action) pair.  A request class missing from the table needs ``admin`` on the
cluster (so a request added later is an operator's until someone says otherwise; a test
checks that every request class is named here).

Summary (the README's table):

- send, batch send, transactional (half) send: ``pub`` on the topic (a retry topic:
  ``sub`` on its group; a system topic: ``admin`` on the cluster)
- pull, offsets, queue locks, group members, send-back: ``sub`` on the group and topics
- a consumer's heartbeat: ``sub`` on each of its groups; a producer's: any user (a
  check-back goes only to producers of the user that sent the half message)
- ending a transaction: the user that sent the half message, with ``pub`` on its topic
  (checked by the transaction service, which knows the half)
- routes: any right on the topic; cluster info, and who one is: any user
- a message looked up by id or key: ``sub`` (or ``admin``) on its topic (checked on what
  was found; a lookup by key leaves out the messages the user may not read)
- topic and group changes, offset resets, DLQ resend, transaction lists and decisions,
  cluster-wide lists, broker registration, replication, the controller,
  users and rules: ``admin`` (on the topic or group where there is one, else the cluster)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from txmq.protocol.wire import (
    ConsumerSendMsgBack,
    DeleteSubscriptionGroup,
    DeleteTopic,
    DlqList,
    DlqResend,
    EndTransaction,
    GetClusterInfo,
    GetConsumerListByGroup,
    GetMaxOffset,
    GetMinOffset,
    GetTopicRoute,
    GetTopicStats,
    GetUser,
    Heartbeat,
    LockBatchMq,
    PullMessage,
    QueryConsumerOffset,
    QueryMessageByKey,
    RecallMessage,
    Request,
    ResetOffset,
    SearchOffset,
    SendBatchMessage,
    SendMessage,
    UnlockBatchMq,
    UnregisterClient,
    UpdateAndCreateTopic,
    UpdateConsumerOffset,
    UpdateSubscriptionGroup,
    ViewMessageById,
)
from txmq.protocol.wire.base import requests
from txmq.protocol.wire.proxying import (
    AckMessage,
    ChangeInvisibleTime,
    DeadLetterPopped,
    GetSubscriptionGroup,
    PopMessage,
    SendMessages,
)
from txmq.security.acl.policy import CLUSTER, Resource, topic_resource

__all__ = ["ADMIN_ONLY", "Need", "needs", "publish_need"]

#: one need: any of these (resource, action) pairs
Need = tuple[tuple[Resource, str], ...]


@functools.lru_cache(maxsize=4096)
def publish_need(topic: str) -> Need:
    """What sending to ``topic`` needs."""
    res = topic_resource(topic)
    if res.kind == "group":  # a retry or dead-letter topic: its group's consumers
        return ((res, "sub"),)
    if res.kind == "cluster":
        return ((res, "admin"),)
    return ((res, "pub"),)


@functools.lru_cache(maxsize=4096)
def _sub_topic(topic: str) -> Need:
    res = topic_resource(topic)
    return ((res, "admin" if res.kind == "cluster" else "sub"),)


@functools.lru_cache(maxsize=4096)
def _group(name: str, action: str = "sub") -> Need:
    return ((Resource("group", name), action),)


def _topic_admin(topic: str) -> Need:
    return ((topic_resource(topic), "admin"),)


def _any_on_topic(topic: str) -> Need:
    res = topic_resource(topic)
    return tuple((res, a) for a in ("pub", "sub", "admin"))


def _queues(group: str, queues: Iterable[tuple[str, int]]) -> list[Need]:
    out = [_group(group)]
    out += [_sub_topic(t) for t in sorted({t for t, _ in queues})]
    return out


_TABLE: dict[type[Request[Any]], Callable[[Any], list[Need]]] = {
    SendMessage: lambda r: [publish_need(r.topic)],
    SendBatchMessage: lambda r: [publish_need(r.topic)],
    RecallMessage: lambda r: [publish_need(r.topic)],
    PullMessage: lambda r: [_group(r.group), _sub_topic(r.topic)],
    QueryConsumerOffset: lambda r: [_group(r.group), _sub_topic(r.topic)],
    UpdateConsumerOffset: lambda r: [_group(r.group), _sub_topic(r.topic)],
    GetMaxOffset: lambda r: [_sub_topic(r.topic)],
    GetMinOffset: lambda r: [_sub_topic(r.topic)],
    SearchOffset: lambda r: [_sub_topic(r.topic)],
    Heartbeat: lambda r: [_group(c.group) for c in r.consumers],
    UnregisterClient: lambda r: [],
    GetConsumerListByGroup: lambda r: [_group(r.group)],
    LockBatchMq: lambda r: _queues(r.group, r.queues),
    UnlockBatchMq: lambda r: _queues(r.group, r.queues),
    ConsumerSendMsgBack: lambda r: [_group(r.group)],
    EndTransaction: lambda r: [],  # the transaction service checks it against the half
    GetTopicRoute: lambda r: [_any_on_topic(r.topic)],
    GetClusterInfo: lambda r: [],
    # checked on what was found: the user may consume (or administer) the message's topic
    QueryMessageByKey: lambda r: [],
    ViewMessageById: lambda r: [],
    GetUser: lambda r: [],  # oneself: any user; another: the service wants cluster admin
    GetTopicStats: lambda r: [tuple((topic_resource(r.topic), a) for a in ("sub", "admin"))],
    UpdateAndCreateTopic: lambda r: [_topic_admin(r.topic)],
    DeleteTopic: lambda r: [_topic_admin(r.topic)],
    UpdateSubscriptionGroup: lambda r: [_group(r.group, "admin")],
    DeleteSubscriptionGroup: lambda r: [_group(r.group, "admin")],
    ResetOffset: lambda r: [_group(r.group, "admin")],
    DlqList: lambda r: [tuple((Resource("group", r.group), a) for a in ("sub", "admin"))],
    DlqResend: lambda r: [_group(r.group, "admin")],
    # a gRPC proxy's: several sends of a topic; pop consumption (the group and the topic)
    SendMessages: lambda r: [publish_need(r.topic)],
    PopMessage: lambda r: [_group(r.group), _sub_topic(r.topic)],
    AckMessage: lambda r: [_group(r.group), _sub_topic(r.topic)],
    ChangeInvisibleTime: lambda r: [_group(r.group), _sub_topic(r.topic)],
    DeadLetterPopped: lambda r: [_group(r.group), _sub_topic(r.topic)],
    GetSubscriptionGroup: lambda r: [_group(r.group)],
}

#: requests that need ``admin`` on the cluster (named, so that the table is complete)
ADMIN_ONLY = frozenset(
    {
        "GetAllTopicConfig",
        "GetBrokerRuntimeInfo",
        "GetAllConsumerOffsets",
        "GetAllSubscriptionGroups",
        "GetConsumerConnectionList",
        "GetTransactions",
        "DecideTransaction",
        "RegisterBroker",
        "UnregisterBroker",
        "ControllerHeartbeat",
        "ElectMaster",
        "GetReplicaInfo",
        "HaHello",
        "HaTransfer",
        "HaGetMetadata",
        "HaHandBackOffsets",
        "UpdateUser",
        "DeleteUser",
        "ListUsers",
        "AddAclRule",
        "DeleteAclRule",
        # broker -> client requests: never a server's to answer
        "CheckTransactionState",
        "NotifyConsumerIdsChanged",
        "ResetConsumerClientOffset",
    }
)
_ADMIN: list[Need] = [((CLUSTER, "admin"),)]


def needs(request: Request[Any]) -> list[Need]:
    """What ``request``'s user must be allowed."""
    rule = _TABLE.get(type(request))
    if rule is None:
        return _ADMIN
    return rule(request)


def unlisted() -> list[str]:
    """Request classes neither in the table nor in :data:`ADMIN_ONLY` (a test wants none)."""
    named = {c.__name__ for c in _TABLE} | ADMIN_ONLY
    return sorted({c.__name__ for c in requests().values()} - named)
