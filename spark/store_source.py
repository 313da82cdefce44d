"""A Spark Python data source that reads a broker's store: ``spark.read.format("txmq-store")``.

It walks the commit-log segment files themselves (one Spark partition per segment), so it
needs neither a running broker nor its consume queues, and it may run beside a live broker:
records are append-only and CRC-checked, and the tail of the newest segment that is still
being written is left for the next run.  Each transaction-relevant record becomes one row:

========  ==================================================================================
kind      what the row is
========  ==================================================================================
half      a half (prepared) message: ``topic`` is its real topic, ``group`` its producer
          group, ``half_offset`` its commit-log offset (the transaction's broker identity)
op        an op record: ``half_offset`` names the half, ``resolution`` is COMMIT, ROLLBACK
          or PARKED (the last one for a half wins)
message   a message in a user topic that is not a transaction's commit (plain sends and the
          outbox relay's); a commit's data comes from its half and op record
retry     a copy in ``%RETRY%<group>``: ``group`` is the consumer group, ``msg_id`` the
          original message id, ``topic`` the original topic
dlq       a copy in ``%DLQ%<group>``, the same columns as ``retry``
========  ==================================================================================

Schedule copies, parked copies (their op record says PARKED) and the commit copies of
transactional messages are skipped by looking at the fixed header only.  Option ``since_ms``
skips segments (whole, when the next one starts before it) and records stored before it.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from broker.consumers import dlq_topic, retry_topic
from broker.transaction import HALF_TOPIC, OP_TOPIC
from txmq.codec import BLANK_MAGIC, HEADER, MESSAGE_MAGIC, PREFIX
from txmq.message import Prop, SysFlag, is_system_topic

__all__ = ["NAME", "SCHEMA", "StoreDataSource", "StoreUnreadable", "scan_segment", "segments"]

NAME = "txmq-store"
SCHEMA = (
    "kind string, topic string, `group` string, msg_id string, transaction_id string, "
    "key string, keys string, half_offset long, resolution string, store_ts long, "
    "reconsume_times int"
)
_FIELDS = [f.split(" ")[0].strip("`") for f in SCHEMA.split(", ")]
_NUMBERS = {"half_offset": pa.int64(), "store_ts": pa.int64(), "reconsume_times": pa.int32()}
_ARROW = pa.schema([(name, _NUMBERS.get(name, pa.string())) for name in _FIELDS])
_RETRY, _DLQ = retry_topic(""), dlq_topic("")
_CHUNK = 8 * 1024 * 1024
_BATCH = 65536
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
#: the two fields of an op record's JSON body the job needs (the broker writes it compactly)
_OP = re.compile(rb'"half_offset":(\d+).*?"resolution":"([A-Z_]+)"')


class StoreUnreadable(RuntimeError):
    """The store folder is missing, or a sealed segment is damaged."""


@dataclass(frozen=True)
class SegmentPart(InputPartition):
    path: str
    last: bool  # the newest segment: a torn tail there is a write in progress


def segments(root: str | Path, since_ms: int = 0) -> list[SegmentPart]:
    """The commit-log segments of the store at ``root`` worth reading, oldest first."""
    folder = Path(root) / "commitlog"
    if not folder.is_dir():
        raise StoreUnreadable(f"{root} is not a txmq broker store (no commitlog folder)")
    files = sorted(p for p in folder.iterdir() if p.name.isdigit())
    parts = [SegmentPart(str(p), i == len(files) - 1) for i, p in enumerate(files)]
    if since_ms > 0:
        # a segment holds records older than the next segment's first record: skip the
        # segments whose successor already starts before the window
        keep = []
        for i, part in enumerate(parts):
            nxt = parts[i + 1] if i + 1 < len(parts) else None
            if nxt is None or _first_store_ts(nxt.path) >= since_ms:
                keep.append(part)
        parts = keep
    return parts


def _first_store_ts(path: str) -> int:
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size or PREFIX.unpack_from(head)[1] != MESSAGE_MAGIC:
        return 1 << 62  # empty or odd: keep the segment before it
    return int(HEADER.unpack_from(head)[9])


def scan_segment(path: str, last: bool, since_ms: int = 0) -> Iterator[pa.RecordBatch]:
    """The rows of one segment file, as Arrow batches (see the module docstring).

    The loop is the job's hot path (one pass of Python per record): the commit copies of
    transactional messages are skipped from the fixed header, everything is CRC-checked,
    and rows are kept as tuples and turned into columns once per batch.
    """
    rows: list[tuple[Any, ...]] = []
    append = rows.append
    header = HEADER.unpack_from
    crc32 = zlib.crc32
    unpack = msgpack.unpackb
    commit_type = SysFlag.TRANSACTION_COMMIT_TYPE
    mask = SysFlag.TRANSACTION_MASK
    uniq, keys_p, tx_p = Prop.UNIQ_KEY, Prop.KEYS, Prop.TRANSACTION_ID
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        off = 0  # position in the file of buf[0]
        buf = f.read(_CHUNK)
        view = memoryview(buf)
        pos = 0
        while off + pos < size:
            avail = len(buf) - pos
            total, magic = PREFIX.unpack_from(buf, pos) if avail >= PREFIX.size else (0, 0)
            if magic == BLANK_MAGIC:
                break  # the filler at a sealed segment's end
            if avail < HEADER.size or avail < total:  # refill: keep the partial record
                more = f.read(max(_CHUNK, total))
                if not more:
                    if last:
                        break  # a write in progress (or torn by a crash)
                    raise StoreUnreadable(f"{path}: partial record at {off + pos}")
                buf = buf[pos:] + more
                view = memoryview(buf)
                off += pos
                pos = 0
                continue
            h = header(buf, pos)
            if (
                magic != MESSAGE_MAGIC
                or total < HEADER.size + 6
                or crc32(view[pos + 12 : pos + total]) != h[2]
            ):
                if last:
                    break  # a write in progress (or torn by a crash): the broker's to repair
                why = f"bad magic {magic:#010x}" if magic != MESSAGE_MAGIC else "CRC mismatch"
                raise StoreUnreadable(f"{path}: record at {off + pos}: {why}")
            at = pos
            pos += total
            sys_flag, store_ts = h[7], h[9]
            if store_ts < since_ms or sys_flag & mask == commit_type:
                continue  # a commit copy: its half and op record say everything
            body_at = at + HEADER.size
            p = body_at + h[12]
            (tlen,) = _U16.unpack_from(buf, p)
            topic = buf[p + 2 : p + 2 + tlen].decode()
            if topic == OP_TOPIC:
                m = _OP.search(buf, body_at, p)
                if m is not None:
                    append(
                        (
                            "op",
                            topic,
                            None,
                            None,
                            None,
                            None,
                            None,
                            int(m[1]),
                            m[2].decode(),
                            store_ts,
                            h[10],
                        )
                    )
                continue
            q = p + 2 + tlen
            (plen,) = _U32.unpack_from(buf, q)
            props: dict[str, str] = unpack(buf[q + 4 : q + 4 + plen]) if plen else {}
            mid = props.get(uniq)
            keys = props.get(keys_p)
            key = keys.split(" ", 1)[0] if keys else mid
            if topic == HALF_TOPIC:
                append(
                    (
                        "half",
                        props.get(Prop.REAL_TOPIC, ""),
                        props.get(Prop.PRODUCER_GROUP),
                        mid,
                        props.get(tx_p),
                        key,
                        keys,
                        h[6],
                        None,
                        store_ts,
                        h[10],
                    )
                )
            elif topic.startswith(_RETRY) or topic.startswith(_DLQ):
                is_retry = topic.startswith(_RETRY)
                kind, group = (
                    ("retry", topic[len(_RETRY) :]) if is_retry else ("dlq", topic[len(_DLQ) :])
                )
                origin = props.get(Prop.ORIGIN_MESSAGE_ID) or mid
                append(
                    (
                        kind,
                        props.get(Prop.RETRY_TOPIC, ""),
                        group,
                        origin,
                        None,
                        keys.split(" ", 1)[0] if keys else origin,
                        keys,
                        None,
                        None,
                        store_ts,
                        h[10],
                    )
                )
            elif not is_system_topic(topic):  # schedule and parked copies are skipped
                append(("message", topic, None, mid, None, key, keys, None, None, store_ts, h[10]))
            if len(rows) >= _BATCH:
                yield _batch(rows)
                rows.clear()
    if rows:
        yield _batch(rows)


def _batch(rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
    columns = list(zip(*rows, strict=True))
    return pa.RecordBatch.from_arrays(
        [pa.array(c, type=t) for c, t in zip(columns, _ARROW.types, strict=True)],
        schema=_ARROW,
    )


class StoreReader(DataSourceReader):
    def __init__(self, root: str, since_ms: int) -> None:
        self.root = root
        self.since_ms = since_ms

    def partitions(self) -> list[SegmentPart]:
        parts = segments(self.root, self.since_ms)
        return parts or [SegmentPart("", True)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SegmentPart)
        if not partition.path:
            return iter(())
        return scan_segment(partition.path, partition.last, self.since_ms)


class StoreDataSource(DataSource):
    """``spark.read.format("txmq-store").option("since_ms", ...).load(store_folder)``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType) -> StoreReader:
        root = self.options.get("path")
        if not root:
            raise StoreUnreadable("txmq-store needs the store folder: .load(path)")
        since = int(self.options.get("since_ms", "0") or 0)
        segments(root)  # fail here, on the driver, with a clear message
        return StoreReader(root, since)
