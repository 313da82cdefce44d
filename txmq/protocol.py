"""The txmq wire protocol, shared by clients and the broker.

Every frame on a connection, in either direction:

    offset  size  field
    0       4     length of the rest of the frame (little-endian)
    4       1     protocol version (VERSION)
    5       1     kind: 0 request, 1 response, 2 oneway request
    6       2     request code (requests) or response code (responses)
    8       4     request id (a response carries its request's id)
    12      4     header length H
    16      H     header: a msgpack map
    16+H    ...   body: raw bytes (message bodies, stored records)

Either side may start a request: clients send, pull and administer; the broker asks
producers for transaction states and tells consumers to rebalance.  An error answer has a
non-zero response code and the header field ``error`` with a readable message.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from txmq.errors import FrameTooLarge, MalformedFrame, UnsupportedVersion

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "PREFIX",
    "VERSION",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "RequestCode",
    "encode_frame",
]

VERSION = 1
PREFIX = struct.Struct("<IBBHII")
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024
_LEN = struct.Struct("<I")


class FrameKind(enum.IntEnum):
    REQUEST = 0
    RESPONSE = 1
    ONEWAY = 2


class RequestCode(enum.IntEnum):
    # client -> broker
    SEND_MESSAGE = 10
    PULL_MESSAGE = 11
    QUERY_MESSAGE_BY_KEY = 12
    QUERY_CONSUMER_OFFSET = 14
    UPDATE_CONSUMER_OFFSET = 15
    UPDATE_AND_CREATE_TOPIC = 17
    GET_ALL_TOPIC_CONFIG = 21
    GET_BROKER_RUNTIME_INFO = 28
    GET_MAX_OFFSET = 30
    GET_MIN_OFFSET = 31
    VIEW_MESSAGE_BY_ID = 33
    HEARTBEAT = 34
    UNREGISTER_CLIENT = 35
    CONSUMER_SEND_MSG_BACK = 36
    END_TRANSACTION = 37
    GET_CONSUMER_LIST_BY_GROUP = 38
    LOCK_BATCH_MQ = 41
    UNLOCK_BATCH_MQ = 42
    GET_ALL_CONSUMER_OFFSETS = 43
    GET_ROUTE_INFO = 105
    GET_TOPIC_STATS = 202
    DELETE_TOPIC = 215
    SEND_BATCH_MESSAGE = 320
    DLQ_LIST = 351
    DLQ_RESEND = 352
    GET_TRANSACTIONS = 353
    # broker -> client
    NOTIFY_CONSUMER_IDS_CHANGED = 40
    CHECK_TRANSACTION_STATE = 39


@dataclass(slots=True)
class Frame:
    kind: FrameKind
    code: int
    request_id: int
    header: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""
    version: int = VERSION


def encode_frame(
    kind: FrameKind | int,
    code: int,
    request_id: int,
    header: dict[str, Any] | None = None,
    body: bytes | memoryview = b"",
) -> bytes:
    head = msgpack.packb(header) if header else b""
    length = PREFIX.size - 4 + len(head) + len(body)
    return b"".join(
        (PREFIX.pack(length, VERSION, int(kind), int(code), request_id, len(head)), head, body)
    )


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole frames back.

    Raises :class:`FrameTooLarge`, :class:`MalformedFrame` or :class:`UnsupportedVersion`;
    after that the stream cannot be resynchronised and the connection should answer and close.
    The exception's ``request_id`` attribute carries the offending frame's id when known.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos = 0
        n = len(buf)
        try:
            while n - pos >= PREFIX.size:
                length, version, kind, code, request_id, hlen = PREFIX.unpack_from(buf, pos)
                if length + 4 > self.max_frame_size:
                    err = FrameTooLarge(
                        f"frame of {length + 4} bytes is over the limit of "
                        f"{self.max_frame_size} bytes"
                    )
                    err.request_id = request_id
                    raise err
                if version != VERSION:
                    uerr = UnsupportedVersion(
                        f"protocol version {version} is not supported (this side speaks {VERSION})"
                    )
                    uerr.request_id = request_id
                    raise uerr
                if kind > FrameKind.ONEWAY or length < PREFIX.size - 4 or hlen > length:
                    merr = MalformedFrame(
                        f"malformed frame (kind={kind}, length={length}, header length={hlen})"
                    )
                    merr.request_id = request_id
                    raise merr
                end = pos + 4 + length
                if end > n:
                    break
                hstart = pos + PREFIX.size
                header: dict[str, Any] = {}
                if hlen:
                    try:
                        header = msgpack.unpackb(buf[hstart : hstart + hlen])
                    except Exception as exc:
                        herr = MalformedFrame(
                            f"frame header is not valid msgpack ({type(exc).__name__}: {exc!r})"
                        )
                        herr.request_id = request_id
                        raise herr from None
                    if not isinstance(header, dict):
                        herr = MalformedFrame("frame header is not a map")
                        herr.request_id = request_id
                        raise herr
                frames.append(
                    Frame(
                        FrameKind(kind), code, request_id, header, bytes(buf[hstart + hlen : end])
                    )
                )
                pos = end
        finally:
            if pos:
                del buf[:pos]
        return frames
