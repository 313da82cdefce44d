"""A Spark Python data source that reads a broker's store: ``spark.read.format("txmq-store")``.

It decodes commit-log segment files (one Spark partition per segment) into the rows described
in :mod:`broker.store.export`, so it needs neither a running broker nor its consume queues,
and it may run beside a live broker: records are append-only and CRC-checked, and the tail
of the newest segment that is still being written is left for the next run.  Sealed
segments the broker has already exported as Parquet are better read as such
(:func:`spark.sources.read_store` does); option ``segments`` names the files to decode.
Option ``since_ms`` skips segments (whole, when the next one starts before it) and records
stored before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from txmq.broker.store.export import FIELDS, StoreUnreadable, scan_segment, segment_files
from txmq.protocol.codec import HEADER, MESSAGE_MAGIC, PREFIX

__all__ = ["NAME", "SCHEMA", "SegmentPart", "StoreDataSource", "StoreUnreadable", "segments"]

NAME = "txmq-store"
_SPARK_TYPES = {"string": "string", "int64": "long", "int32": "int"}
#: the rows' Spark schema (DDL), from the export's columns
SCHEMA = ", ".join(f"`{name}` {_SPARK_TYPES[t]}" for name, t in FIELDS)


@dataclass(frozen=True)
class SegmentPart(InputPartition):
    path: str
    last: bool  # the newest segment: a torn tail there is a write in progress


def segments(root: str | Path, since_ms: int = 0) -> list[SegmentPart]:
    """The commit-log segments of the store at ``root`` worth reading, oldest first."""
    files = segment_files(root)
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


class StoreReader(DataSourceReader):
    def __init__(self, root: str, since_ms: int, only: set[str] | None) -> None:
        self.root = root
        self.since_ms = since_ms
        self.only = only

    def partitions(self) -> list[SegmentPart]:
        parts = segments(self.root, self.since_ms)
        if self.only is not None:
            parts = [p for p in parts if Path(p.path).name in self.only]
        return parts or [SegmentPart("", True)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, SegmentPart)
        if not partition.path:
            return iter(())
        return scan_segment(partition.path, partition.last, self.since_ms)


class StoreDataSource(DataSource):
    """``spark.read.format("txmq-store").option("since_ms", ...).load(store_folder)``;
    ``.option("segments", "name,name")`` decodes only those segment files."""

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
        only = self.options.get("segments")
        segments(root)  # fail here, on the driver, with a clear message
        return StoreReader(
            root, since, None if only is None else set(filter(None, only.split(",")))
        )
