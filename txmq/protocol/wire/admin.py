"""Operators' requests: topics, consumer-group configs, queue statistics, message lookups,
offsets, broker information and the dead-letter queue."""

from __future__ import annotations

from typing import Annotated

import msgspec

from txmq.protocol.wire.base import Empty, Key, Name, Request, Response, Topic
from txmq.protocol.wire.codes import RequestCode
from txmq.protocol.wire.messaging import Offset

__all__ = [
    "DeleteSubscriptionGroup",
    "DeleteTopic",
    "DlqList",
    "DlqPage",
    "DlqResend",
    "DlqResent",
    "GetAllConsumerOffsets",
    "GetAllSubscriptionGroups",
    "GetAllTopicConfig",
    "GetBrokerRuntimeInfo",
    "GetTopicStats",
    "GroupConfigList",
    "GroupConfigRow",
    "GroupDeleted",
    "GroupOffset",
    "GroupOffsets",
    "MessageCount",
    "OffsetsReset",
    "QueryMessageByKey",
    "QueueReset",
    "QueueStats",
    "ResetOffset",
    "RuntimeInfo",
    "SearchOffset",
    "TopicInfo",
    "TopicList",
    "TopicRow",
    "TopicStats",
    "UpdateAndCreateTopic",
    "UpdateSubscriptionGroup",
    "ViewMessageById",
]


class TopicInfo(Response, frozen=True, kw_only=True, omit_defaults=True):
    topic: str
    #: over every broker set in ``brokers`` (one broker: its own count)
    queue_nums: int
    #: queue count per broker set (filled by a client of name servers; empty from one broker)
    brokers: dict[str, int] = {}


class UpdateAndCreateTopic(Request[TopicInfo], frozen=True, kw_only=True, omit_defaults=True):
    """Create a topic or change its queue count (default: the broker's default)."""

    CODE = RequestCode.UPDATE_AND_CREATE_TOPIC
    topic: Topic
    queue_nums: int | None = None


class DeleteTopic(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.DELETE_TOPIC
    topic: Topic


class TopicRow(Response, frozen=True, kw_only=True, omit_defaults=True):
    topic: str
    queue_nums: int
    system: bool
    messages: int
    max_offset_total: int
    #: queue count per broker set (filled by a client of name servers, which sums
    #: ``queue_nums``, ``messages`` and ``max_offset_total`` over them; empty from one broker)
    brokers: dict[str, int] = {}


class TopicList(Response, frozen=True, kw_only=True, omit_defaults=True):
    topics: list[TopicRow]


class GetAllTopicConfig(Request[TopicList], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.GET_ALL_TOPIC_CONFIG


class GroupConfigRow(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A consumer group's config (RocketMQ's SubscriptionGroupConfig)."""

    group: str
    #: the broker delivers a queue's messages one batch at a time, in order
    fifo: bool
    #: failed deliveries retried before a message becomes a dead letter
    retry_max_times: int
    #: the broker sets with this config (filled by a client of name servers; empty from
    #: one broker)
    brokers: list[str] = []


class UpdateSubscriptionGroup(
    Request[GroupConfigRow], frozen=True, kw_only=True, omit_defaults=True
):
    """Create a consumer group's config (defaults for what is not given: not FIFO, 16
    retries) or change what is given."""

    CODE = RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP
    group: Name
    fifo: bool | None = None
    #: 0 to 64
    retry_max_times: int | None = None


class GroupConfigList(Response, frozen=True, kw_only=True, omit_defaults=True):
    groups: list[GroupConfigRow]


class GetAllSubscriptionGroups(
    Request[GroupConfigList], frozen=True, kw_only=True, omit_defaults=True
):
    """Every configured consumer group (a group nobody configured has the defaults)."""

    CODE = RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG


class GroupDeleted(Response, frozen=True, kw_only=True, omit_defaults=True):
    #: whether the broker had a config for the group
    deleted: bool


class DeleteSubscriptionGroup(Request[GroupDeleted], frozen=True, kw_only=True, omit_defaults=True):
    """Forget a consumer group's config (it has the defaults again)."""

    CODE = RequestCode.DELETE_SUBSCRIPTIONGROUP
    group: Name


class QueueStats(Response, frozen=True, kw_only=True, omit_defaults=True):
    queue_id: int
    min_offset: int
    max_offset: int
    #: store time of the newest message (ms), 0 if the queue is empty
    last_store_ts: int
    #: the broker set holding the queue (filled by a client of name servers)
    broker_name: str = ""


class TopicStats(Response, frozen=True, kw_only=True, omit_defaults=True):
    topic: str
    queues: list[QueueStats]


class GetTopicStats(Request[TopicStats], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.GET_TOPIC_STATS
    topic: Topic


class ViewMessageById(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    """The stored record (the frame's body) of a message id or offset message id."""

    CODE = RequestCode.VIEW_MESSAGE_BY_ID
    msg_id: Key


class MessageCount(Response, frozen=True, kw_only=True, omit_defaults=True):
    count: int


class QueryMessageByKey(Request[MessageCount], frozen=True, kw_only=True, omit_defaults=True):
    """The records (the frame's body) of up to ``max_num`` messages with key ``key``."""

    CODE = RequestCode.QUERY_MESSAGE_BY_KEY
    key: Key
    max_num: int = 32


class GroupOffset(Response, frozen=True, kw_only=True, omit_defaults=True):
    group: str
    topic: str
    queue_id: int
    offset: int
    max_offset: int
    lag: int
    #: the broker set holding the queue (filled by a client of name servers)
    broker_name: str = ""


class GroupOffsets(Response, frozen=True, kw_only=True, omit_defaults=True):
    offsets: list[GroupOffset]


class GetAllConsumerOffsets(Request[GroupOffsets], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.GET_ALL_CONSUMER_OFFSETS


#: ms since the epoch
EpochMs = Annotated[int, msgspec.Meta(ge=0)]


class SearchOffset(Request[Offset], frozen=True, kw_only=True, omit_defaults=True):
    """The first offset of a queue whose message was stored at or after ``timestamp_ms``
    (the queue's min offset if that is before everything, its max offset if nothing was
    stored since)."""

    CODE = RequestCode.SEARCH_OFFSET_BY_TIMESTAMP
    topic: Topic
    queue_id: int
    timestamp_ms: EpochMs


class QueueReset(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A queue's committed offset before and after a reset (old -1: none was committed)."""

    queue_id: int
    old_offset: int
    new_offset: int
    #: the broker set holding the queue (filled by a client of name servers)
    broker_name: str = ""


class OffsetsReset(Response, frozen=True, kw_only=True, omit_defaults=True):
    queues: list[QueueReset]
    #: connected members of the group the broker told (RESET_CONSUMER_CLIENT_OFFSET)
    notified: int = 0


class ResetOffset(Request[OffsetsReset], frozen=True, kw_only=True, omit_defaults=True):
    """Move consumer group ``group``'s offsets of every queue of ``topic`` on this broker
    to the first message stored at or after ``timestamp_ms`` (RocketMQ's
    INVOKE_BROKER_TO_RESET_OFFSET, ``resetOffsetByTime``), and tell the group's connected
    members.  ``force`` false: only where that moves an offset back."""

    CODE = RequestCode.INVOKE_BROKER_TO_RESET_OFFSET
    group: Name
    topic: Topic
    timestamp_ms: EpochMs
    force: bool = True


class RuntimeInfo(Response, frozen=True, kw_only=True, omit_defaults=True):
    version: str
    address: str
    pid: int
    flush: str
    store: str
    uptime_s: float
    connections: int
    topics: int
    commit_log_min_offset: int
    commit_log_max_offset: int
    flushed_offset: int
    pending_transactions: int
    #: damage the store found and went on without, since it opened (all of it counted)
    store_damage_count: int = 0
    #: messages known to be gone among that damage (stored, and then not found at start-up)
    store_lost_messages: int = 0
    #: the newest findings, each a readable line (kind, commit-log offset, what was found)
    store_damage: list[str] = []
    #: messages stored by sends / handed out by pulls per second, over the last minute
    put_tps: float = 0.0
    get_tps: float = 0.0
    #: and since the broker started
    put_total: int = 0
    get_total: int = 0
    #: who the broker is in its cluster
    cluster: str = ""
    broker_name: str = ""
    #: the name servers it registers with (empty: it runs alone, and is all there is)
    namesrv: list[str] = []
    #: the broker's own id (``--broker-id``; under a controller the master registers with
    #: the name servers as 0 whatever its own id is)
    broker_id: int = 0
    #: replication: RocketMQ's brokerRole (SYNC_MASTER, ASYNC_MASTER or SLAVE; "" from a
    #: broker that does not say), and the newest epoch of its broker set it knows
    broker_role: str = ""
    epoch: int = 0
    #: whether a controller gives it its role, and where the controllers are
    controlled: bool = False
    controllers: list[str] = []
    #: where its slaves copy its commit log from (its HA port)
    ha_address: str = ""
    #: a master: each slave connected to it (by the slave's own id) — the bytes of the log
    #: it lacks, and seconds since it last had all of it (0: it has it all; -1: never yet)
    slave_lag_bytes: dict[int, int] = {}
    slave_lag_s: dict[int, float] = {}
    #: a master: the slaves in sync (own ids; under a controller, the sync state set the
    #: controller approved)
    in_sync: list[int] = []
    #: a slave: its master (own id, -1: not known; client address; HA address), whether it
    #: is connected to it, the bytes it lacks of what the master last said it had, and
    #: seconds since the master last answered (-1: never)
    master_id: int = -1
    master_address: str = ""
    master_ha_address: str = ""
    connected: bool = False
    lag_bytes: int = 0
    last_contact_s: float = -1.0


class GetBrokerRuntimeInfo(Request[RuntimeInfo], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.GET_BROKER_RUNTIME_INFO


class DlqPage(Response, frozen=True, kw_only=True, omit_defaults=True):
    """Where a DLQ listing stopped; the records are the frame's body."""

    next_offset: int
    min_offset: int
    max_offset: int


class DlqList(Request[DlqPage], frozen=True, kw_only=True, omit_defaults=True):
    """Up to ``max`` dead letters of consumer group ``group`` from queue offset ``offset``."""

    CODE = RequestCode.DLQ_LIST
    group: Name
    offset: int = 0
    max: int = 32


class DlqResent(Response, frozen=True, kw_only=True, omit_defaults=True):
    resent: int
    missing: list[str] = []


class DlqResend(Request[DlqResent], frozen=True, kw_only=True, omit_defaults=True):
    """Store dead letters of ``group`` again in its retry topic: ``msg_ids``, or ``all``."""

    CODE = RequestCode.DLQ_RESEND
    group: Name
    msg_ids: list[str] = []
    all: bool = False
