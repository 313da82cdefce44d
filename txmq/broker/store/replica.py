"""What replication needs from the store: the master reads its commit log as whole records,
a slave appends them byte for byte at the same offsets and dispatches them, and a replica
that had bytes its (new) master never had cuts its log back (epoch fencing).

The master's commit log and a slave's are the same byte stream: the slave writes every
record (and every segment-end blank) at the offset the master wrote it, so the two logs
are byte-identical up to the shorter one.  A slave's consume queues and key index are its
own, built from what it appends exactly as ``put`` builds the master's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from txmq.protocol.codec import (
    PREFIX,
    CorruptRecord,
    check_record,
    read_header,
    record_topic_and_props,
)

from .recovery import tag_code_of
from .types import StoreError

if TYPE_CHECKING:
    import threading

    from .commitlog import CommitLog
    from .consumequeue import ConsumeQueue
    from .flush import CommitLogFlusher
    from .index import IndexService

__all__ = ["ReplicaError", "ReplicaWrites"]

log = logging.getLogger("txmq.broker.store")

#: what a master sends at most per transfer (a single larger record goes whole)
DEFAULT_CHUNK = 1024 * 1024


class ReplicaError(StoreError):
    """Replicated bytes that cannot be appended here (wrong offset, damaged, out of order)."""


class ReplicaWrites:
    """Mixed into :class:`MessageStore`."""

    _lock: threading.Lock
    _cl: CommitLog
    _cqs: dict[tuple[str, int], ConsumeQueue]
    _index: IndexService
    _flusher: CommitLogFlusher
    _running: bool
    _last_ckpt: int

    if TYPE_CHECKING:

        def _queue_for_put(self, topic: str, queue_id: int) -> ConsumeQueue | None: ...
        def _index_keys(self, props: dict[str, str], phy: int, ts: int) -> None: ...
        def _sealed(self) -> None: ...
        def _checkpoint(self) -> None: ...

    # -- the master's side ----------------------------------------------------------------

    def read_records(self, offset: int, max_bytes: int = DEFAULT_CHUNK) -> bytes:
        """Whole records from ``offset`` (a record boundary), within one segment and at
        most ``max_bytes`` (unless the first record alone is larger); ``b""`` when nothing
        was written there yet.  Raises :class:`ReplicaError` for an offset no longer (or
        never) on disk."""
        cl = self._cl
        end = cl.write_pos
        if offset == end:
            return b""
        if offset < cl.min_offset or offset > end:
            raise ReplicaError(
                f"offset {offset} is outside this commit log [{cl.min_offset}, {end})"
            )
        ss = cl.segment_size
        seg_end = offset - offset % ss + ss
        hi = min(end, seg_end)
        data = cl.read(offset, min(hi, offset + max_bytes) - offset)
        if data is None:
            raise ReplicaError(f"cannot read the commit log at {offset}")
        if offset + len(data) == hi:
            return data  # everything up to the end: whole records by construction
        cut = _last_boundary(data)
        if cut == 0:  # the first record is larger than max_bytes
            head = cl.read(offset, PREFIX.size)
            if head is None:
                raise ReplicaError(f"cannot read the commit log at {offset}")
            total = PREFIX.unpack(head)[0]
            whole = cl.read(offset, abs(total))
            if whole is None:
                raise ReplicaError(f"cannot read the record at {offset} ({total} bytes)")
            return whole
        return data[:cut]

    # -- a slave's side -------------------------------------------------------------------

    def start_replica_at(self, offset: int) -> None:
        """Make an empty commit log begin at ``offset`` (a segment start): a new slave of
        a master whose oldest segments were deleted copies from its oldest one."""
        with self._lock:
            cl = self._cl
            if cl.write_pos != cl.min_offset or cl.write_pos != 0:
                raise ReplicaError("only an empty store can start at another offset")
            if offset % cl.segment_size:
                raise ReplicaError(f"offset {offset} is not a segment start")
            cl.restart_at(offset)

    def append_replicated(self, offset: int, data: bytes) -> set[tuple[str, int]]:
        """Append ``data`` — whole records the master wrote at ``offset`` — at the same
        offset, CRC-checked, and dispatch them to consume queues and the key index.
        Returns the queues that got messages.  Nothing is written if any record is bad."""
        touched: set[tuple[str, int]] = set()
        if not data:
            return touched
        with self._lock:
            if not self._running:
                raise ReplicaError("the store is not running")
            cl = self._cl
            if offset != cl.write_pos:
                raise ReplicaError(
                    f"replicated bytes for offset {offset}, but this commit log ends at "
                    f"{cl.write_pos}"
                )
            seg_end = offset - offset % cl.segment_size + cl.segment_size
            if offset + len(data) > seg_end:
                raise ReplicaError("replicated bytes cross a segment end")
            records = _check_all(data, offset, seg_end)
            expected: dict[tuple[str, int], int] = {}
            plan = []
            for pos, size in records:
                head = read_header(data, pos)
                topic, props = record_topic_and_props(data, pos)
                cq = self._queue_for_put(topic, head.queue_id)
                if cq is None:
                    raise ReplicaError(f"record at {offset + pos}: bad topic or queue id")
                key = (topic, head.queue_id)
                want = expected.get(key, cq.max_offset)
                # a slave that began past offset 0 (start_replica_at) meets each queue
                # somewhere in its middle
                joins = want == 0 and key not in expected and cl.min_offset > 0
                if head.queue_offset != want and not joins:
                    raise ReplicaError(
                        f"record at {offset + pos} is entry {head.queue_offset} of {topic}/"
                        f"{head.queue_id}, but that queue's next entry here is {want}"
                    )
                expected[key] = head.queue_offset + 1
                plan.append((cq, head.queue_offset, offset + pos, size, props, head))
            for cq, qoff, *_ in plan:
                cq.reserve(qoff)
            last_ts = plan[-1][5].store_timestamp if plan else 0
            cl.append(data, last_ts)
            for cq, qoff, phy, size, props, head in plan:
                cq.put(qoff, phy, size, tag_code_of(props))
                if props:
                    self._index_keys(props, phy, head.store_timestamp)
                touched.add((cq.topic, cq.queue_id))
            if cl.write_pos == seg_end:
                cl.roll()  # the blank is written already: this only opens the next segment
                self._sealed()
        return touched

    def truncate_to(self, offset: int) -> int:
        """Cut the commit log (and consume queues and index with it) back to ``offset``, a
        record boundary; returns the bytes removed.  A replica does this before it follows
        a master that never had its tail."""
        with self._lock:
            cl = self._cl
            if offset >= cl.write_pos:
                return 0
            if offset < cl.min_offset:
                raise ReplicaError(
                    f"cannot cut the commit log to {offset}: it begins at {cl.min_offset}"
                )
            removed = cl.truncate(offset)
            for cq in self._cqs.values():
                cq.truncate_phy(offset)
            self._index.truncate(offset, trust_slots=False)
            self._flusher.flushed = min(self._flusher.flushed, offset)
            self._last_ckpt = -1
        log.warning("commit log cut back to offset %d (%d bytes removed)", offset, removed)
        self._checkpoint()
        return removed


def _last_boundary(data: bytes) -> int:
    """The end of the last whole record in ``data`` (which begins with a record)."""
    pos = 0
    n = len(data)
    while pos + PREFIX.size <= n:
        total = PREFIX.unpack_from(data, pos)[0]
        if total < PREFIX.size or pos + total > n:
            break
        pos += total
    return pos


def _check_all(data: bytes, offset: int, seg_end: int) -> list[tuple[int, int]]:
    """(position, size) of each message record in ``data``; raises on anything damaged.
    A blank may only fill the segment's end."""
    out: list[tuple[int, int]] = []
    pos = 0
    n = len(data)
    while pos < n:
        try:
            size = check_record(data, pos)
        except CorruptRecord as exc:
            raise ReplicaError(f"replicated record at {offset + pos} is damaged: {exc}") from None
        if size < 0:
            if offset + pos - size != seg_end or pos - size != n:
                raise ReplicaError(f"a blank at {offset + pos} does not end its segment")
            break
        out.append((pos, size))
        pos += size
    return out
