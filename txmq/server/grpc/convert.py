"""The server side of RocketMQ 5's protocol (``apache.rocketmq.v2``): answers' statuses,
resources, stored messages as delivered.  What clients share with it (timestamps, the
error <-> code table) is in :mod:`txmq.protocol.grpc_convert`.

The generated protobuf modules come from the official Python client's package
(``rocketmq.grpc_protocol``, the ``txmq[grpc]`` extra); nothing of it is copied here.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

from rocketmq.grpc_protocol import definition_pb2 as pb

from txmq.protocol.grpc_convert import code_of, duration, duration_ms, ms_of, timestamp
from txmq.protocol.message import MessageExt, Prop, SysFlag
from txmq.protocol.wire.errors import TxmqError

__all__ = [
    "BORN_HOST",
    "GrpcError",
    "duration",
    "duration_ms",
    "message_of",
    "ms_of",
    "resource_name",
    "status",
    "status_of",
    "timestamp",
]


class GrpcError(Exception):
    """A request the endpoint refuses with a RocketMQ code of its own choosing."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def status(code: int = pb.OK, message: str = "OK") -> Any:
    return pb.Status(code=code, message=message)


def status_of(exc: Exception) -> Any:
    """The Status answering a failed request (an unexpected error: INTERNAL_SERVER_ERROR)."""
    if isinstance(exc, GrpcError):
        return status(exc.code, str(exc))
    if isinstance(exc, TxmqError):
        return status(code_of(exc), str(exc))
    return status(pb.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")


def resource_name(resource: Any, what: str) -> str:
    """The name of a topic or group ``Resource`` (txmq has no namespaces: a client that
    names one is told so)."""
    name = str(resource.name)
    code = pb.ILLEGAL_TOPIC if what == "topic" else pb.ILLEGAL_CONSUMER_GROUP
    if not name:
        raise GrpcError(code, f"the request names no {what}")
    if resource.resource_namespace:
        raise GrpcError(
            code,
            f"{what} {name!r} is in namespace {resource.resource_namespace!r}: txmq has no "
            "namespaces (leave the client's namespace empty)",
        )
    return name


def now_ms() -> int:
    return time.time_ns() // 1_000_000


#: where a gRPC client's born_host is kept
BORN_HOST = "__BORN_HOST"
#: properties txmq keeps in its own fields of the protobuf message (or not at all)
_SYSTEM = Prop.ALL | {"__CQ_TAG_CODE"}


def message_of(
    msg: MessageExt,
    *,
    topic: Any,
    handle: str = "",
    attempt: int = 0,
    invisible_ms: int = 0,
    store_host: str = "",
) -> Any:
    """A stored message as RocketMQ 5 delivers it (``topic``: the Resource to show — a
    retried message is shown under its original topic)."""
    props = msg.all_properties
    sp = pb.SystemProperties(
        message_id=msg.msg_id,
        body_digest=pb.Digest(type=pb.CRC32, checksum=f"{zlib.crc32(msg.body) & 0xFFFFFFFF:08X}"),
        body_encoding=pb.IDENTITY,
        born_timestamp=timestamp(msg.born_timestamp),
        born_host=props.get(BORN_HOST, ""),
        store_timestamp=timestamp(msg.store_timestamp),
        store_host=store_host,
        queue_id=msg.queue_id,
        queue_offset=msg.queue_offset,
    )
    tag = props.get(Prop.TAGS)
    if tag:
        sp.tag = tag
    keys = props.get(Prop.KEYS)
    if keys:
        sp.keys.extend(k for k in keys.split(" ") if k)
    group = props.get(Prop.SHARDING_KEY)
    if group:
        sp.message_group = group
        sp.message_type = pb.FIFO
    elif SysFlag.transaction_value(msg.sys_flag) != SysFlag.TRANSACTION_NOT_TYPE:
        sp.message_type = pb.TRANSACTION
    elif Prop.DELIVER_AT in props:
        sp.message_type = pb.DELAY
    else:
        sp.message_type = pb.NORMAL
    deliver_at = props.get(Prop.DELIVER_AT)
    sp.delivery_timestamp.CopyFrom(
        timestamp(int(deliver_at) if deliver_at else msg.store_timestamp)
    )
    if handle:
        sp.receipt_handle = handle
        sp.delivery_attempt = max(attempt, 1)
        sp.invisible_duration.seconds = invisible_ms // 1000
        sp.invisible_duration.nanos = (invisible_ms % 1000) * 1_000_000
    user = {k: v for k, v in props.items() if k not in _SYSTEM and not k.startswith("__")}
    return pb.Message(topic=topic, user_properties=user, system_properties=sp, body=msg.body)
