"""The commit-log record format, shared by the broker's store and the clients.

The broker ships stored records to consumers byte for byte, so both sides decode the
same layout.  Every integer is little-endian.

    offset  size  field
    0       4     total size of the record (this field included)
    4       4     magic (MESSAGE_MAGIC, or BLANK_MAGIC for the filler at a segment's end)
    8       4     CRC-32 of bytes [12, total size)
    12      4     queue id
    16      4     flag (user flag, unused by txmq itself)
    20      8     queue offset (logical offset within the queue)
    28      8     commit-log offset (physical offset of this record)
    36      4     system flag (transaction bits, see SysFlag)
    40      8     born timestamp (ms)
    48      8     store timestamp (ms)
    56      4     reconsume times
    60      8     prepared transaction offset
    68      4     body length B
    72      B     body
    72+B    2     topic length T
    74+B    T     topic (UTF-8)
    74+B+T  4     properties length P
    78+B+T  P     properties (msgpack map of str to str)
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from txmq.protocol.message import MessageExt

__all__ = [
    "BLANK_MAGIC",
    "HEADER",
    "MESSAGE_MAGIC",
    "MIN_RECORD_SIZE",
    "CorruptRecord",
    "RecordHeader",
    "decode_record",
    "decode_records",
    "encode_message",
    "encode_record",
    "record_topic_and_props",
]

MESSAGE_MAGIC = 0x54584D51  # "TXMQ"
BLANK_MAGIC = 0x424C4E4B  # "BLNK"
HEADER = struct.Struct("<IIIIIQQIQQIQI")
PREFIX = struct.Struct("<II")  # total size, magic
MIN_RECORD_SIZE = HEADER.size + 2 + 4
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_CRC_FROM = 12


class CorruptRecord(ValueError):
    """A record whose framing, magic or CRC does not check out."""


@dataclass(slots=True, frozen=True)
class RecordHeader:
    total_size: int
    queue_id: int
    queue_offset: int
    commit_log_offset: int
    sys_flag: int
    store_timestamp: int


def encode_record(
    *,
    topic: str,
    queue_id: int,
    body: bytes,
    properties: dict[str, str],
    queue_offset: int,
    commit_log_offset: int,
    born_timestamp: int,
    store_timestamp: int,
    sys_flag: int = 0,
    flag: int = 0,
    reconsume_times: int = 0,
    prepared_transaction_offset: int = 0,
) -> bytes:
    topic_b = topic.encode()
    props_b = msgpack.packb(properties) if properties else b""
    total = HEADER.size + len(body) + 2 + len(topic_b) + 4 + len(props_b)
    head = HEADER.pack(
        total,
        MESSAGE_MAGIC,
        0,
        queue_id,
        flag,
        queue_offset,
        commit_log_offset,
        sys_flag,
        born_timestamp,
        store_timestamp,
        reconsume_times,
        prepared_transaction_offset,
        len(body),
    )
    tail = b"".join(
        (head[_CRC_FROM:], body, _U16.pack(len(topic_b)), topic_b, _U32.pack(len(props_b)), props_b)
    )
    crc = zlib.crc32(tail)
    return b"".join((head[:8], _U32.pack(crc), tail))


def blank_record(size: int) -> bytes:
    """The filler written at the end of a segment that has no room for the next record."""
    if size < PREFIX.size:
        return b"\0" * size
    return PREFIX.pack(size, BLANK_MAGIC) + b"\0" * (size - PREFIX.size)


def check_record(buf: bytes | memoryview, pos: int = 0) -> int:
    """Validate the record at ``pos``; return its size or raise :class:`CorruptRecord`.

    A blank filler returns its size as a negative number.
    """
    if len(buf) - pos < PREFIX.size:
        raise CorruptRecord("truncated record prefix")
    total, magic = PREFIX.unpack_from(buf, pos)
    if magic == BLANK_MAGIC:
        if total < PREFIX.size or pos + total > len(buf):
            raise CorruptRecord("bad blank filler size")
        return -int(total)
    if magic != MESSAGE_MAGIC:
        raise CorruptRecord(f"bad magic {magic:#x}")
    if total < MIN_RECORD_SIZE or pos + total > len(buf):
        raise CorruptRecord(f"bad record size {total}")
    (crc,) = _U32.unpack_from(buf, pos + 8)
    if zlib.crc32(memoryview(buf)[pos + _CRC_FROM : pos + total]) != crc:
        raise CorruptRecord("CRC mismatch")
    body_len = _U32.unpack_from(buf, pos + HEADER.size - 4)[0]
    p = pos + HEADER.size + body_len
    if p + 2 > pos + total:
        raise CorruptRecord("body overruns the record")
    (tlen,) = _U16.unpack_from(buf, p)
    p += 2 + tlen
    if p + 4 > pos + total:
        raise CorruptRecord("topic overruns the record")
    (plen,) = _U32.unpack_from(buf, p)
    if p + 4 + plen != pos + total:
        raise CorruptRecord("record size does not match its fields")
    return int(total)


def read_header(buf: bytes | memoryview, pos: int = 0) -> RecordHeader:
    f = HEADER.unpack_from(buf, pos)
    return RecordHeader(
        total_size=f[0],
        queue_id=f[3],
        queue_offset=f[5],
        commit_log_offset=f[6],
        sys_flag=f[7],
        store_timestamp=f[9],
    )


def record_topic_and_props(buf: bytes | memoryview, pos: int = 0) -> tuple[str, dict[str, str]]:
    """The topic and properties of a (valid) record, without copying the body."""
    body_len = _U32.unpack_from(buf, pos + HEADER.size - 4)[0]
    p = pos + HEADER.size + body_len
    (tlen,) = _U16.unpack_from(buf, p)
    topic = bytes(buf[p + 2 : p + 2 + tlen]).decode()
    p += 2 + tlen
    (plen,) = _U32.unpack_from(buf, p)
    props: dict[str, str] = msgpack.unpackb(bytes(buf[p + 4 : p + 4 + plen])) if plen else {}
    return topic, props


def decode_record(buf: bytes | memoryview, pos: int = 0, *, verify: bool = False) -> MessageExt:
    """Decode one record (optionally checking its CRC first)."""
    if verify:
        size = check_record(buf, pos)
        if size < 0:
            raise CorruptRecord("blank filler is not a message")
    (
        total,
        magic,
        _crc,
        queue_id,
        flag,
        queue_offset,
        commit_log_offset,
        sys_flag,
        born_ts,
        store_ts,
        reconsume_times,
        prepared_offset,
        body_len,
    ) = HEADER.unpack_from(buf, pos)
    if magic != MESSAGE_MAGIC:
        raise CorruptRecord(f"bad magic {magic:#x}")
    p = pos + HEADER.size
    body = bytes(buf[p : p + body_len])
    topic, props = record_topic_and_props(buf, pos)
    return MessageExt(
        topic=topic,
        body=body,
        queue_id=queue_id,
        queue_offset=queue_offset,
        commit_log_offset=commit_log_offset,
        store_size=total,
        born_timestamp=born_ts,
        store_timestamp=store_ts,
        sys_flag=sys_flag,
        flag=flag,
        reconsume_times=reconsume_times,
        prepared_transaction_offset=prepared_offset,
        all_properties=props,
    )


def decode_records(
    buf: bytes | memoryview,
    *,
    verify: bool = True,
    on_corrupt: Callable[[int, CorruptRecord], None] | None = None,
) -> list[MessageExt]:
    """Decode records laid end to end (a pull answer's body).

    A record that does not check out raises :class:`CorruptRecord`, unless ``on_corrupt``
    is given: then it is told ``(position, error)`` and the record is skipped (or, when
    its size cannot be trusted either, everything after it).
    """
    out: list[MessageExt] = []
    pos = 0
    n = len(buf)
    while pos < n:
        total = 0
        try:
            if n - pos < PREFIX.size:
                raise CorruptRecord("truncated record")
            total = PREFIX.unpack_from(buf, pos)[0]
            out.append(decode_record(buf, pos, verify=verify))
        except CorruptRecord as exc:
            if on_corrupt is None:
                raise
            on_corrupt(pos, exc)
            if total < MIN_RECORD_SIZE or pos + total > n:
                break
        pos += total
    return out


def encode_message(msg: MessageExt) -> bytes:
    """The record of ``msg`` (what :func:`decode_record` turns back into it): a message that
    came another way than a record (RocketMQ 5's protocol) handed to code that reads records."""
    return encode_record(
        topic=msg.topic,
        queue_id=msg.queue_id,
        body=msg.body,
        properties=msg.all_properties,
        queue_offset=msg.queue_offset,
        commit_log_offset=msg.commit_log_offset,
        born_timestamp=msg.born_timestamp,
        store_timestamp=msg.store_timestamp,
        sys_flag=msg.sys_flag,
        flag=msg.flag,
        reconsume_times=msg.reconsume_times,
        prepared_transaction_offset=msg.prepared_transaction_offset,
    )
