"""Between txmq's messages and RocketMQ 5's (``apache.rocketmq.v2``), client side.

Outgoing: the properties txmq's producer core puts on a message (:meth:`Message.wire_properties`
and the transactional ones) become a protobuf ``Message``: TAGS → tag, KEYS → keys,
SHARDING_KEY → message_group (FIFO), a DELAY level or a delivery time →
delivery_timestamp, TRAN_MSG → TRANSACTION, CHECK_IMMUNITY_TIME_IN_SECONDS →
orphaned_transaction_recovery_duration, the rest → user properties.  txmq's properties
that RocketMQ reserves (``__transactionId__``) travel under a user-property name of their
own (:data:`ALIASES`) and come back under their txmq name.

Incoming: a protobuf ``Message`` (received, or the half of a check-back) becomes the
:class:`MessageExt` txmq's listeners and checkers get.

Imported only when a client uses ``transport="grpc"`` (the ``txmq[grpc]`` extra).
"""

from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from rocketmq.grpc_protocol import definition_pb2 as pb

from txmq.protocol.message import MessageExt, Prop, new_message_id
from txmq.protocol.wire.errors import (
    AuthenticationFailed,
    BadRequest,
    BrokerBusy,
    DiskFull,
    FlushDiskTimeout,
    FlushSlaveTimeout,
    InvalidReceiptHandle,
    InvalidTopic,
    MessageNotFound,
    MessageTooLarge,
    NoPermission,
    NotMaster,
    RequestTimeout,
    ServerError,
    SlaveNotAvailable,
    TopicNotFound,
    TransactionNotFound,
    TxmqError,
    UnsupportedRequest,
)

__all__ = [
    "ALIASES",
    "CODES",
    "DEFAULT_DELAY_LEVELS_MS",
    "DLQ_REASON_METADATA",
    "check_error",
    "code_of",
    "delay_ms",
    "duration",
    "duration_ms",
    "error_of",
    "from_proto",
    "ms_of",
    "timestamp",
    "to_proto",
]

#: the metadata key of a dead letter's reason on ForwardMessageToDeadLetterQueue (the request
#: has no field for one; "-bin": any bytes, UTF-8 here): txmq's client and endpoint use it
DLQ_REASON_METADATA = "x-txmq-dlq-reason-bin"

#: RocketMQ's default delay levels ("1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h
#: 2h"), in ms: a delay level becomes a delivery time this long from now
DEFAULT_DELAY_LEVELS_MS: tuple[int, ...] = tuple(
    s * 1000
    for s in (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200)
)

#: txmq properties RocketMQ reserves -> the user-property name they travel under
ALIASES: Mapping[str, str] = {Prop.TRANSACTION_ID: "txmq-transaction-id"}
_UNALIASED = {alias: name for name, alias in ALIASES.items()}
#: properties the core sets that have no place in RocketMQ 5 (no producer groups)
_DROPPED = frozenset({Prop.PRODUCER_GROUP, Prop.WAIT_STORE})
_HOST = socket.gethostname()


def timestamp(ms: int) -> Any:
    from google.protobuf.timestamp_pb2 import Timestamp

    return Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def ms_of(ts: Any) -> int:
    """Milliseconds of a ``Timestamp``.  A seconds field above 10^11 (year 5138) holds
    milliseconds: the official Python client 5.1.2 puts its delivery time (ms) there."""
    seconds = int(ts.seconds)
    if seconds > 100_000_000_000:
        return seconds
    return seconds * 1000 + int(ts.nanos) // 1_000_000


def duration(ms: int) -> Any:
    from google.protobuf.duration_pb2 import Duration

    return Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def duration_ms(d: Any) -> int:
    return int(d.seconds) * 1000 + int(d.nanos) // 1_000_000


def delay_ms(level: int, levels: Sequence[int] = DEFAULT_DELAY_LEVELS_MS) -> int:
    """How long delay level ``level`` (1-based) waits; levels past the last wait as long
    as the last."""
    if level < 1:
        raise ValueError(f"delay level {level} is not 1 or more")
    return levels[min(level, len(levels)) - 1]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def to_proto(
    topic: str,
    body: bytes,
    properties: Mapping[str, str],
    *,
    born_ms: int = 0,
    now_ms: int | None = None,
) -> Any:
    """The RocketMQ 5 message for a message txmq's core would send with ``properties``."""
    now = _now_ms() if now_ms is None else now_ms
    sp = pb.SystemProperties(
        message_id=properties.get(Prop.UNIQ_KEY) or new_message_id(),
        body_digest=pb.Digest(type=pb.CRC32, checksum=f"{zlib.crc32(body) & 0xFFFFFFFF:08X}"),
        body_encoding=pb.IDENTITY,
        born_timestamp=timestamp(born_ms or now),
        born_host=_HOST,
    )
    user: dict[str, str] = {}
    transactional = properties.get(Prop.TRAN_MSG) == "true"
    deliver_at: int | None = None
    for name, value in properties.items():
        if name in (Prop.UNIQ_KEY, Prop.TRAN_MSG) or name in _DROPPED:
            continue
        if name == Prop.TAGS:
            sp.tag = value
        elif name == Prop.KEYS:
            sp.keys.extend(k for k in value.split(" ") if k)
        elif name == Prop.SHARDING_KEY:
            sp.message_group = value
        elif name == Prop.DELAY:
            deliver_at = now + delay_ms(int(value))
        elif name == Prop.DELIVER_AT:
            deliver_at = int(value)
        elif name == Prop.CHECK_IMMUNITY_TIME_IN_SECONDS:
            recovery = duration(max(int(float(value) * 1000), 1000))
            sp.orphaned_transaction_recovery_duration.CopyFrom(recovery)
        elif name in ALIASES:
            user[ALIASES[name]] = value
        elif name in _UNALIASED:
            raise BadRequest(f"property name {name!r} is reserved by txmq's gRPC transport")
        else:
            user[name] = value
    if transactional:
        if sp.HasField("message_group"):
            raise UnsupportedRequest(
                "a transactional message with a sharding key: RocketMQ 5's protocol has no "
                "transactional FIFO messages (a message group and TRANSACTION exclude each "
                "other); send it without sharding_key, or use transport='txmq'"
            )
        if deliver_at is not None:
            raise BadRequest("a transactional message cannot be delayed")
        sp.message_type = pb.TRANSACTION
    elif sp.HasField("message_group"):
        if deliver_at is not None:
            raise UnsupportedRequest(
                "a delayed message with a sharding key: RocketMQ 5's protocol has no delayed "
                "FIFO messages"
            )
        sp.message_type = pb.FIFO
    elif deliver_at is not None:
        sp.message_type = pb.DELAY
        sp.delivery_timestamp.CopyFrom(timestamp(deliver_at))
    else:
        sp.message_type = pb.NORMAL
    return pb.Message(
        topic=pb.Resource(name=topic), user_properties=user, system_properties=sp, body=body
    )


def from_proto(m: Any) -> MessageExt:
    """The :class:`MessageExt` of a RocketMQ 5 message (received, or a check-back's half)."""
    sp = m.system_properties
    props: dict[str, str] = {}
    for name, value in m.user_properties.items():
        props[_UNALIASED.get(name, name)] = value
    props[Prop.UNIQ_KEY] = sp.message_id
    if sp.HasField("tag") and sp.tag:
        props[Prop.TAGS] = sp.tag
    if sp.keys:
        props[Prop.KEYS] = " ".join(sp.keys)
    if sp.HasField("message_group") and sp.message_group:
        props[Prop.SHARDING_KEY] = sp.message_group
    if sp.message_type == pb.DELAY and sp.HasField("delivery_timestamp"):
        props[Prop.DELIVER_AT] = str(ms_of(sp.delivery_timestamp))
    if sp.message_type == pb.TRANSACTION:
        props[Prop.TRAN_MSG] = "true"
    born = ms_of(sp.born_timestamp) if sp.HasField("born_timestamp") else 0
    stored = ms_of(sp.store_timestamp) if sp.HasField("store_timestamp") else born
    attempt = sp.delivery_attempt if sp.HasField("delivery_attempt") else 1
    body = bytes(m.body)
    return MessageExt(
        topic=m.topic.name,
        body=body,
        queue_id=sp.queue_id,
        queue_offset=sp.queue_offset if sp.HasField("queue_offset") else 0,
        commit_log_offset=0,
        store_size=len(body),
        born_timestamp=born,
        store_timestamp=stored,
        reconsume_times=max(attempt - 1, 0),
        all_properties=props,
    )


# -- txmq's errors <-> status codes ------------------------------------------------------------

#: txmq's errors as RocketMQ codes (what a txmq broker answers), most specific first
CODES: tuple[tuple[type[TxmqError], int], ...] = (
    (MessageTooLarge, pb.MESSAGE_BODY_TOO_LARGE),
    (TopicNotFound, pb.TOPIC_NOT_FOUND),
    (InvalidTopic, pb.ILLEGAL_TOPIC),
    (TransactionNotFound, pb.INVALID_TRANSACTION_ID),
    (MessageNotFound, pb.MESSAGE_NOT_FOUND),
    (InvalidReceiptHandle, pb.INVALID_RECEIPT_HANDLE),
    (NoPermission, pb.FORBIDDEN),
    (AuthenticationFailed, pb.UNAUTHORIZED),
    (FlushDiskTimeout, pb.MASTER_PERSISTENCE_TIMEOUT),
    (FlushSlaveTimeout, pb.SLAVE_PERSISTENCE_TIMEOUT),
    (SlaveNotAvailable, pb.HA_NOT_AVAILABLE),
    (BrokerBusy, pb.TOO_MANY_REQUESTS),
    (RequestTimeout, pb.PROXY_TIMEOUT),
    (UnsupportedRequest, pb.NOT_IMPLEMENTED),
    # a client retries these on another queue (which may be another broker set)
    (DiskFull, pb.INTERNAL_SERVER_ERROR),
    (NotMaster, pb.INTERNAL_SERVER_ERROR),
    (BadRequest, pb.BAD_REQUEST),
)

#: RocketMQ codes as txmq's errors (what a client reads): the codes above, and the other
#: codes a RocketMQ proxy answers (unlisted: BadRequest for 4xxxx, ServerError for 5xxxx)
_ERRORS: dict[int, type[TxmqError]] = {
    **{
        code: kind for kind, code in CODES if code not in (pb.BAD_REQUEST, pb.INTERNAL_SERVER_ERROR)
    },
    pb.NOT_FOUND: TopicNotFound,
    pb.PAYMENT_REQUIRED: NoPermission,
    pb.PAYLOAD_TOO_LARGE: MessageTooLarge,
    pb.MESSAGE_PROPERTIES_TOO_LARGE: MessageTooLarge,
    pb.REQUEST_HEADER_FIELDS_TOO_LARGE: MessageTooLarge,
    pb.REQUEST_TIMEOUT: RequestTimeout,
    pb.UNSUPPORTED: UnsupportedRequest,
    pb.VERSION_UNSUPPORTED: UnsupportedRequest,
    pb.VERIFY_FIFO_MESSAGE_UNSUPPORTED: UnsupportedRequest,
}


def code_of(exc: TxmqError) -> int:
    """The RocketMQ code answering ``exc`` (INTERNAL_SERVER_ERROR if none fits)."""
    for kind, code in CODES:
        if isinstance(exc, kind):
            return code
    return int(pb.INTERNAL_SERVER_ERROR)


def error_of(status: Any, what: str = "") -> TxmqError:
    """The txmq error for a RocketMQ status that is not OK (4xxxx not listed: BadRequest,
    not retriable; 5xxxx not listed: ServerError, retriable)."""
    code = int(status.code)
    text = f"{what}: {status.message}" if what else str(status.message)
    text = f"{text} (RocketMQ code {pb.Code.Name(code) if code in pb.Code.values() else code})"
    kind = _ERRORS.get(code)
    if kind is not None:
        return kind(text)
    if 40000 <= code < 50000:
        return BadRequest(text)
    return ServerError(text)


def check_error(status: Any, what: str = "") -> None:
    """Raise the txmq error of ``status`` unless it is OK."""
    if status.code != pb.OK:
        raise error_of(status, what)
