"""Configuration, results and errors of the message store."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "FlushMode",
    "GetResult",
    "GetStatus",
    "PutResult",
    "PutStatus",
    "RecoveryStats",
    "StoreConfig",
    "StoreError",
]

#: commit-log segments are named by their start offset, zero-padded to this width
NAME_WIDTH = 20


class FlushMode(enum.StrEnum):
    ASYNC = "async"
    SYNC = "sync"


@dataclass(frozen=True)
class StoreConfig:
    root: Path
    segment_size: int = 256 * 1024 * 1024
    cq_entries_per_file: int = 300_000
    index_slots: int = 500_000
    index_entries_per_file: int = 2_000_000
    flush_mode: FlushMode = FlushMode.ASYNC
    flush_interval_ms: int = 500
    cq_flush_interval_ms: int = 1000
    retention_hours: float = 72.0
    retention_check_interval_s: float = 10.0
    max_message_size: int = 4 * 1024 * 1024
    #: export every sealed commit-log segment as Parquet, in a child process, for the
    #: reconciliation jobs (needs pyarrow; off with a log line without it)
    export_segments: bool = True
    #: refuse writes while the disk holding the store is used over this share (disk.py)
    disk_max_used_ratio: float = 0.90

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "flush_mode", FlushMode(self.flush_mode))
        if self.segment_size < 4096:
            raise ValueError(f"segment_size must be at least 4096 bytes, not {self.segment_size}")
        if self.cq_entries_per_file < 1:
            raise ValueError("cq_entries_per_file must be positive")
        if self.index_slots < 1 or self.index_entries_per_file < 1:
            raise ValueError("index_slots and index_entries_per_file must be positive")
        if self.flush_interval_ms <= 0 or self.cq_flush_interval_ms <= 0:
            raise ValueError("flush intervals must be positive")
        if self.retention_hours <= 0 or self.retention_check_interval_s <= 0:
            raise ValueError("retention_hours and retention_check_interval_s must be positive")
        if self.max_message_size < 1:
            raise ValueError("max_message_size must be positive")
        if not 0 < self.disk_max_used_ratio <= 1:
            raise ValueError("disk_max_used_ratio must be above 0 and at most 1")


class PutStatus(enum.Enum):
    PUT_OK = "PUT_OK"
    #: bad topic name, queue id or tag code
    MESSAGE_ILLEGAL = "MESSAGE_ILLEGAL"
    #: encoded properties longer than 32767 bytes (RocketMQ's limit)
    PROPERTIES_SIZE_EXCEEDED = "PROPERTIES_SIZE_EXCEEDED"
    #: the store is not started or already shut down
    SERVICE_NOT_AVAILABLE = "SERVICE_NOT_AVAILABLE"
    #: the disk holding the store is full (or used over disk_max_used_ratio); nothing was
    #: written; try again once space is freed
    DISK_FULL = "DISK_FULL"
    #: the store belongs to a slave (or a deposed master): it takes replicated bytes only
    NOT_MASTER = "NOT_MASTER"


@dataclass(frozen=True, slots=True)
class PutResult:
    status: PutStatus
    commit_log_offset: int
    queue_offset: int
    store_timestamp: int
    size: int
    #: why the store refused the message (DISK_FULL), for the client
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is PutStatus.PUT_OK

    @property
    def end_offset(self) -> int:
        """The commit-log offset just past this record (what to wait for to be flushed)."""
        return self.commit_log_offset + self.size


class GetStatus(enum.Enum):
    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"
    OFFSET_FOUND_NULL = "OFFSET_FOUND_NULL"
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"


@dataclass(slots=True)
class GetResult:
    status: GetStatus
    records: list[bytes] = field(default_factory=list)
    next_begin_offset: int = 0
    min_offset: int = 0
    max_offset: int = 0
    #: the commit-log offset of the first record read (-1: none): how far behind the
    #: log's end the reader is
    first_phy_offset: int = -1


@dataclass(frozen=True)
class RecoveryStats:
    #: commit-log offset the validating scan started from (the checkpoint, or the first segment)
    scanned_from: int
    #: records dispatched again to consume queues / the index during recovery
    redispatched: int
    #: bytes cut from the commit log's tail (torn or corrupt writes)
    truncated_bytes: int
    #: whether the previous run stopped cleanly (shutdown() was called)
    clean: bool
    took_ms: float


class StoreError(Exception):
    """The store cannot do what was asked (I/O failure, not running, bad directory)."""
