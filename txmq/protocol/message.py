"""The message model shared by clients and the broker.

A :class:`Message` is what a producer sends; a :class:`MessageExt` is what the broker
stored and a consumer receives (RocketMQ's ``MessageExt``).  System properties use
RocketMQ's names so that the semantics read the same as the Java documentation.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from txmq.protocol.wire.errors import BadRequest

__all__ = [
    "DECISION_TOPIC",
    "HALF_TOPIC",
    "MAX_DLQ_REASON",
    "OP_TOPIC",
    "PARKED_TOPIC",
    "RECALL_TOPIC",
    "SCHEDULE_TOPIC",
    "SYSTEM_TOPIC_PREFIXES",
    "TIMER_TOPIC",
    "TOPIC_NAME_PATTERN",
    "FixedIdMessage",
    "Message",
    "MessageExt",
    "MessageQueue",
    "Prop",
    "SysFlag",
    "clip_reason",
    "dlq_topic",
    "is_system_topic",
    "new_message_id",
    "parse_subscription",
    "retry_topic",
    "stable_hash",
    "tag_hash",
    "used_up_reason",
    "validate_topic_name",
]


class MessageQueue(NamedTuple):
    """A queue of a topic: (topic, broker set's name, queue id)."""

    topic: str
    broker_name: str
    queue_id: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.broker_name}/{self.queue_id}"


class Prop:
    """Reserved property names (RocketMQ's ``MessageConst``)."""

    KEYS = "KEYS"
    TAGS = "TAGS"
    UNIQ_KEY = "UNIQ_KEY"
    DELAY = "DELAY"
    WAIT_STORE = "WAIT"
    RETRY_TOPIC = "RETRY_TOPIC"
    REAL_TOPIC = "REAL_TOPIC"
    REAL_QID = "REAL_QID"
    TRAN_MSG = "TRAN_MSG"
    PRODUCER_GROUP = "PGROUP"
    ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
    TRANSACTION_CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
    CHECK_IMMUNITY_TIME_IN_SECONDS = "CHECK_IMMUNITY_TIME_IN_SECONDS"
    SHARDING_KEY = "SHARDING_KEY"
    MAX_RECONSUME_TIMES = "MAX_RECONSUME_TIMES"
    CONSUME_START_TIME = "CONSUME_START_TIME"
    CQ_TAG_CODE = "__CQ_TAG_CODE"  # the consume-queue tag code when it is not the tag's hash
    TRANSACTION_ID = "__transactionId__"  # the local transaction a half message belongs to
    DELIVER_AT = "TIMER_DELIVER_MS"  # deliver at this time (ms since the epoch), RocketMQ 5's
    RECHECK_OF = "TXMQ_RECHECK_OF"  # a re-checked half's copy: the parked half's offset
    DLQ_REASON = "TXMQ_DLQ_REASON"  # a dead letter's copy: why it is there (txmq's own)
    TIMER_OF = "TXMQ_TIMER_OF"  # a timer's delivered copy: the timer's commit-log offset
    ACL_USER = "TXMQ_ACL_USER"  # a half message's sender (access control on): who ends it

    ALL: frozenset[str] = frozenset(
        {
            KEYS,
            TAGS,
            UNIQ_KEY,
            DELAY,
            WAIT_STORE,
            RETRY_TOPIC,
            REAL_TOPIC,
            REAL_QID,
            TRAN_MSG,
            PRODUCER_GROUP,
            ORIGIN_MESSAGE_ID,
            TRANSACTION_CHECK_TIMES,
            CHECK_IMMUNITY_TIME_IN_SECONDS,
            SHARDING_KEY,
            MAX_RECONSUME_TIMES,
            CONSUME_START_TIME,
            CQ_TAG_CODE,
            TRANSACTION_ID,
            DELIVER_AT,
            RECHECK_OF,
            DLQ_REASON,
            TIMER_OF,
            ACL_USER,
        }
    )


class SysFlag:
    """Bits of a record's system flag (RocketMQ's ``MessageSysFlag``)."""

    TRANSACTION_NOT_TYPE = 0x0
    TRANSACTION_PREPARED_TYPE = 0x4
    TRANSACTION_COMMIT_TYPE = 0x8
    TRANSACTION_ROLLBACK_TYPE = 0xC
    TRANSACTION_MASK = 0xC

    @staticmethod
    def transaction_value(flag: int) -> int:
        return flag & SysFlag.TRANSACTION_MASK


SYSTEM_TOPIC_PREFIXES = (
    "RMQ_SYS_",
    "TXMQ_SYS_",
    "%RETRY%",
    "%DLQ%",
    "SCHEDULE_TOPIC_",
    "TRANS_CHECK_MAX_TIME",
)
#: half (prepared) messages, their op records, halves parked after the last check-back
HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
PARKED_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
#: operators' decisions on half messages (txmq's own)
DECISION_TOPIC = "TXMQ_SYS_TRANS_DECISION"
#: delayed messages wait here, a queue per delay level
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
#: timer messages (an exact delivery time) wait here, one queue (RocketMQ 5's
#: rmq_sys_wheel_timer); its consume queue is the timer log
TIMER_TOPIC = "RMQ_SYS_WHEEL_TIMER"
#: recalls of timer messages (RocketMQ 5's recall), one record each: in the commit log, so
#: that a restarted broker and a slave become master know them too
RECALL_TOPIC = "RMQ_SYS_TIMER_RECALL"


def retry_topic(group: str) -> str:
    """Where consumer group ``group``'s failed messages wait for their next attempt."""
    return f"%RETRY%{group}"


def dlq_topic(group: str) -> str:
    """Where consumer group ``group``'s messages go after their last attempt."""
    return f"%DLQ%{group}"


#: the longest dead-letter reason kept (characters; a longer one is cut to end in "…")
MAX_DLQ_REASON = 1024


def clip_reason(reason: str) -> str:
    """``reason`` cut to :data:`MAX_DLQ_REASON` characters (a cut one ends in "…")."""
    return reason if len(reason) <= MAX_DLQ_REASON else reason[: MAX_DLQ_REASON - 1] + "…"


def used_up_reason(max_times: int, last_error: str = "") -> str:
    """The reason of a dead letter whose retries are used up (and its last error)."""
    reason = f"max reconsume times ({max_times}) used up"
    return f"{reason}: {last_error}" if last_error else reason


_TOPIC_MAX_LEN = 127
_TOPIC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-%|.")
#: the rule of :func:`validate_topic_name` as a regular expression
TOPIC_NAME_PATTERN = rf"\A(?!\.\.?\Z)[A-Za-z0-9_%|.\-]{{1,{_TOPIC_MAX_LEN}}}\Z"


def is_system_topic(topic: str) -> bool:
    return topic.startswith(SYSTEM_TOPIC_PREFIXES)


def validate_topic_name(topic: str) -> str | None:
    """Return why ``topic`` is not a valid topic name, or ``None`` if it is."""
    if not isinstance(topic, str) or not topic:
        return "topic name is empty"
    if len(topic) > _TOPIC_MAX_LEN:
        return f"topic name is longer than {_TOPIC_MAX_LEN} characters"
    bad = set(topic) - _TOPIC_CHARS
    if bad:
        return f"topic name {topic!r} has characters outside [A-Za-z0-9_.|%-]: {sorted(bad)!r}"
    if topic in (".", ".."):  # a topic's consume queues live in a folder of its name
        return f"topic name {topic!r} is not allowed (it names a folder)"
    return None


def stable_hash(key: str | bytes) -> int:
    """A 63-bit hash that is the same in every process (unlike the salted ``hash()``)."""
    data = key.encode() if isinstance(key, str) else key
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def tag_hash(tag: str | None) -> int:
    """The tag code stored in consume-queue entries (0 for "no tag")."""
    if not tag:
        return 0
    return stable_hash(tag)


def parse_subscription(expression: str | None) -> set[int] | None:
    """Tag codes for ``"tagA || tagB"``; ``None`` for ``"*"`` (everything)."""
    if expression is None:
        return None
    expression = expression.strip()
    if expression in ("", "*"):
        return None
    tags = [t.strip() for t in expression.split("||")]
    if any(not t for t in tags):
        raise BadRequest(f"subscription expression {expression!r} has an empty tag")
    return {tag_hash(t) for t in tags}


_ID_PREFIX = (os.urandom(4) + (os.getpid() & 0xFFFF).to_bytes(2, "big")).hex().upper()
_ID_COUNTER = itertools.count(int.from_bytes(os.urandom(2), "big"))
_ID_LOCK = threading.Lock()


def new_message_id() -> str:
    """A unique message id: process prefix (random 4 bytes + pid), time, counter — 32 hex."""
    with _ID_LOCK:
        n = next(_ID_COUNTER) & 0xFFFFFFFF
    millis = int(time.time() * 1000) & 0xFFFFFFFFFFFF
    return f"{_ID_PREFIX}{millis:012X}{n:08X}"


def _check_property(name: str, value: str) -> None:
    if not isinstance(name, str) or not isinstance(value, str):
        raise TypeError(f"message property {name!r} must map a str to a str")
    if name in Prop.ALL:
        raise ValueError(f"message property name {name!r} is reserved by txmq")


@dataclass(slots=True)
class Message:
    """A message to send: topic, body bytes, optional tag, keys and user properties.

    Delayed delivery: ``delay_level`` (1..18, the broker's levels), or an exact time:
    ``deliver_at`` (an aware :class:`~datetime.datetime`; a naive one is local time) or
    ``delay`` (a :class:`~datetime.timedelta` from the moment it is sent) — at most one of
    the three, and no further ahead than the broker's ``timer_max_delay_s`` (3 days).
    """

    topic: str
    body: bytes
    tags: str | None = None
    keys: tuple[str, ...] | list[str] | str = ()
    properties: dict[str, str] = field(default_factory=dict)
    delay_level: int = 0
    deliver_at: datetime | None = None
    delay: timedelta | None = None

    def key_list(self) -> list[str]:
        if isinstance(self.keys, str):
            return [k for k in self.keys.split(" ") if k]
        return [k for k in self.keys if k]

    def wire_properties(self, msg_id: str) -> dict[str, str]:
        """All properties as stored: the user's and the system ones."""
        props: dict[str, str] = {}
        for name, value in self.properties.items():
            _check_property(name, value)
            props[name] = value
        props[Prop.UNIQ_KEY] = msg_id
        if self.tags:
            props[Prop.TAGS] = self.tags
        keys = self.key_list()
        if keys:
            props[Prop.KEYS] = " ".join(keys)
        if self.delay_level:
            props[Prop.DELAY] = str(self.delay_level)
        at = self.deliver_at_ms()
        if at is not None:
            props[Prop.DELIVER_AT] = str(at)
        return props

    def deliver_at_ms(self) -> int | None:
        """The exact delivery time asked for (ms since the epoch), None if none."""
        if self.deliver_at is None and self.delay is None:
            return None
        if self.delay_level or (self.deliver_at is not None and self.delay is not None):
            raise ValueError("give at most one of delay_level, deliver_at and delay")
        if self.deliver_at is not None:
            if not isinstance(self.deliver_at, datetime):
                raise TypeError(f"deliver_at must be a datetime, not {self.deliver_at!r}")
            return round(self.deliver_at.timestamp() * 1000)
        if not isinstance(self.delay, timedelta):
            raise TypeError(f"delay must be a timedelta, not {self.delay!r}")
        if self.delay < timedelta(0):
            raise ValueError(f"delay {self.delay} is negative")
        return time.time_ns() // 1_000_000 + round(self.delay / timedelta(milliseconds=1))


@dataclass(slots=True)
class FixedIdMessage(Message):
    """A message whose id is chosen before it is sent (``fixed_id``) and kept on every
    (re-)send, instead of a fresh one per send: a sender that records the id first (the
    outbox's row, a saga's deadline) and may send the message again after a crash."""

    fixed_id: str = ""

    def wire_properties(self, msg_id: str) -> dict[str, str]:
        return Message.wire_properties(self, self.fixed_id or msg_id)


@dataclass(slots=True)
class MessageExt:
    """A stored message as a consumer or an operator sees it."""

    topic: str
    body: bytes
    queue_id: int
    queue_offset: int
    commit_log_offset: int
    store_size: int
    born_timestamp: int
    store_timestamp: int
    sys_flag: int = 0
    flag: int = 0
    reconsume_times: int = 0
    prepared_transaction_offset: int = 0
    all_properties: dict[str, str] = field(default_factory=dict)
    #: the broker set it was pulled from (a consumer sends it back there to retry it)
    broker_name: str = ""

    @property
    def msg_id(self) -> str:
        return self.all_properties.get(Prop.UNIQ_KEY) or self.offset_msg_id

    @property
    def offset_msg_id(self) -> str:
        return f"{self.commit_log_offset:016X}"

    @property
    def tags(self) -> str | None:
        return self.all_properties.get(Prop.TAGS)

    @property
    def keys(self) -> list[str]:
        raw = self.all_properties.get(Prop.KEYS, "")
        return [k for k in raw.split(" ") if k]

    @property
    def properties(self) -> dict[str, str]:
        """The user's properties (system ones removed)."""
        return {k: v for k, v in self.all_properties.items() if k not in Prop.ALL}

    @property
    def dlq_reason(self) -> str | None:
        """Why this dead letter (a copy in ``%DLQ%<group>``) is there; None if not said."""
        return self.all_properties.get(Prop.DLQ_REASON)

    def get_property(self, name: str) -> str | None:
        return self.all_properties.get(name)

    def to_dict(self, body_limit: int | None = 200) -> dict[str, object]:
        body: object
        try:
            text = self.body.decode()
            body = text if body_limit is None else text[:body_limit]
        except UnicodeDecodeError:
            body = self.body.hex() if body_limit is None else self.body[:body_limit].hex()
        return {
            "msg_id": self.msg_id,
            "offset_msg_id": self.offset_msg_id,
            "topic": self.topic,
            "queue_id": self.queue_id,
            "queue_offset": self.queue_offset,
            "commit_log_offset": self.commit_log_offset,
            "store_size": self.store_size,
            "tags": self.tags,
            "keys": self.keys,
            "properties": self.properties,
            "born_timestamp": self.born_timestamp,
            "store_timestamp": self.store_timestamp,
            "reconsume_times": self.reconsume_times,
            "sys_flag": self.sys_flag,
            "body": body,
        }
