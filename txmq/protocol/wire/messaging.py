"""Sending, pulling, routes and consumer offsets: the hot path."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from txmq.protocol.wire.base import Empty, Name, NameOrEmpty, Request, Response, Topic
from txmq.protocol.wire.codes import RequestCode

__all__ = [
    "BatchEntry",
    "BatchResult",
    "ConsumerSendMsgBack",
    "GetMaxOffset",
    "GetMinOffset",
    "Offset",
    "PullMessage",
    "PullStatus",
    "Pulled",
    "QueryConsumerOffset",
    "RecallMessage",
    "Recalled",
    "SendBack",
    "SendBatchMessage",
    "SendMessage",
    "Sent",
    "UpdateConsumerOffset",
]

PullStatus = Literal["FOUND", "NO_NEW_MSG", "NO_MATCHED_MSG", "OFFSET_ILLEGAL"]
#: a message's flag: a 32-bit unsigned field of the stored record
Flag = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
#: a message's born time in ms since the epoch (0: the broker's now), unsigned when stored
BornTimestamp = Annotated[int, msgspec.Meta(ge=0)]


class Sent(Response, frozen=True, kw_only=True, omit_defaults=True):
    """Where the broker stored a message (a half message: its commit-log offset too)."""

    msg_id: str
    offset_msg_id: str
    queue_id: int
    queue_offset: int
    store_timestamp: int
    transaction_offset: int = -1
    #: "" (SEND_OK), or why the message is stored but not yet safe: FLUSH_SLAVE_TIMEOUT,
    #: SLAVE_NOT_AVAILABLE (SYNC_MASTER)
    status: str = ""


class SendMessage(Request[Sent], frozen=True, kw_only=True, omit_defaults=True):
    """Store the frame's body as a message in ``topic``/``queue_id`` (a half message when
    its TRAN_MSG property is "true", a delayed one with DELAY)."""

    CODE = RequestCode.SEND_MESSAGE
    topic: Topic
    queue_id: int
    properties: dict[str, str] = {}
    born_timestamp: BornTimestamp = 0
    flag: Flag = 0
    group: NameOrEmpty = ""


class Recalled(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A timer message that will not be delivered: when it would have been."""

    msg_id: str
    deliver_at_ms: int


class RecallMessage(Request[Recalled], frozen=True, kw_only=True, omit_defaults=True):
    """Recall the timer message ``msg_id`` of ``topic`` before its delivery time (RocketMQ
    5's recall): it is never delivered.  One that was delivered, or that this broker does
    not hold, is MessageNotFound."""

    CODE = RequestCode.RECALL_MESSAGE
    topic: Topic
    msg_id: str
    group: NameOrEmpty = ""


class BatchEntry(Response, frozen=True, kw_only=True, omit_defaults=True):
    """One message of a batch: its body is the next ``size`` bytes of the frame's body."""

    size: int
    properties: dict[str, str] = {}
    born_timestamp: BornTimestamp = 0


class BatchResult(Response, frozen=True, kw_only=True, omit_defaults=True):
    msg_ids: list[str]
    offset_msg_ids: list[str]
    queue_id: int
    queue_offset: int
    store_timestamp: int
    status: str = ""


class SendBatchMessage(Request[BatchResult], frozen=True, kw_only=True, omit_defaults=True):
    """Store several messages of one topic in one queue, contiguously."""

    CODE = RequestCode.SEND_BATCH_MESSAGE
    topic: Topic
    queue_id: int
    messages: list[BatchEntry]
    group: NameOrEmpty = ""


class Pulled(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A pull's outcome; the records found are the frame's body."""

    status: PullStatus
    next_offset: int
    min_offset: int
    max_offset: int
    #: where to pull this queue from next (RocketMQ's suggestWhichBrokerId): 0 the master,
    #: 1 a slave (the reader is so far behind that the master would read from disk)
    suggest_broker_id: int = 0


class PullMessage(Request[Pulled], frozen=True, kw_only=True, omit_defaults=True):
    """Up to ``max_msgs`` records of a queue from ``offset``; with nothing to read, the
    broker holds the request up to ``suspend_ms`` (long polling)."""

    CODE = RequestCode.PULL_MESSAGE
    topic: Topic
    queue_id: int
    offset: int
    group: str = ""
    max_msgs: int = 32
    suspend_ms: int = 0
    subscription: str | None = None


class Offset(Response, frozen=True, kw_only=True, omit_defaults=True):
    offset: int


class QueryConsumerOffset(Request[Offset], frozen=True, kw_only=True, omit_defaults=True):
    """A consumer group's committed offset of a queue (-1: none)."""

    CODE = RequestCode.QUERY_CONSUMER_OFFSET
    group: Name
    topic: Name
    queue_id: int


class UpdateConsumerOffset(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.UPDATE_CONSUMER_OFFSET
    group: Name
    topic: Name
    queue_id: int
    offset: int


class GetMaxOffset(Request[Offset], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.GET_MAX_OFFSET
    topic: Topic
    queue_id: int


class GetMinOffset(Request[Offset], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.GET_MIN_OFFSET
    topic: Topic
    queue_id: int


class SendBack(Response, frozen=True, kw_only=True, omit_defaults=True):
    """Where a failed message went: the retry topic at ``delay_level``, or the DLQ (-1)."""

    topic: str
    reconsume_times: int
    delay_level: int


class ConsumerSendMsgBack(Request[SendBack], frozen=True, kw_only=True, omit_defaults=True):
    """A consumer failed the message at ``commit_log_offset``: retry it later (after
    ``delay_level``, 0: 3 + reconsume times; -1: to the dead-letter queue at once).
    ``reason``: why (the listener's ``DeadLetter`` reason, or its last error), kept by a
    dead-letter copy (property ``TXMQ_DLQ_REASON``, cut to 1024 characters)."""

    CODE = RequestCode.CONSUMER_SEND_MSG_BACK
    group: Name
    commit_log_offset: int
    delay_level: int = 0
    max_reconsume_times: int = 16
    origin_msg_id: str = ""
    reason: str = ""
