"""The read side: pulling from a consume queue and key-index queries (no locks taken)."""

from __future__ import annotations

from collections.abc import Iterator

from txmq.protocol.codec import (
    HEADER,
    MESSAGE_MAGIC,
    PREFIX,
    CorruptRecord,
    check_record,
    read_header,
    record_topic_and_props,
)
from txmq.protocol.message import Prop

from .commitlog import CommitLog
from .consumequeue import CQ_ENTRY, ConsumeQueue
from .damage import DamageLedger
from .index import IndexService, key_hash, uniq_key_hash
from .types import GetResult, GetStatus

__all__ = [
    "StoreReads",
    "get_from_queue",
    "offset_by_time",
    "query_all_by_uniq_key",
    "query_by_key",
    "query_by_uniq_key",
]

_MAX_FILTER_SCAN = 800  # consume-queue entries examined per get (RocketMQ: 16000 bytes)
_READ_GAP = 16 * 1024  # read neighbouring records with one pread when this close together
_READ_SPAN = 8 * 1024 * 1024


def get_from_queue(
    cl: CommitLog,
    cq: ConsumeQueue,
    offset: int,
    max_count: int,
    max_bytes: int,
    tag_codes: set[int] | None,
    damage: DamageLedger | None = None,
) -> GetResult:
    """RocketMQ's ``DefaultMessageStore.getMessage`` for an existing queue.

    Each record is checked (CRC) as it is read: a damaged one is skipped and reported to
    ``damage``, and the answer's next offset moves past it as if it had been consumed."""
    hi = cq.max_offset
    lo = cq.min_offset
    if hi == 0:
        return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, [], 0, lo, hi)
    if offset < lo:
        return GetResult(GetStatus.OFFSET_TOO_SMALL, [], lo, lo, hi)
    if offset == hi:
        return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, [], offset, lo, hi)
    if offset > hi:
        return GetResult(GetStatus.OFFSET_OVERFLOW_BADLY, [], hi, lo, hi)
    cl_min = cl.min_offset
    status = GetStatus.NO_MATCHED_MESSAGE
    picked: list[tuple[int, int, int]] = []
    total = 0
    cur = offset
    budget = max(_MAX_FILTER_SCAN, max_count)
    full = False
    while cur < hi and budget > 0 and not full:
        raw = cq.read(cur, min(budget, hi - cur))
        if not raw:  # the file holding ``cur`` is gone: skip to the next one
            if not picked:
                status = GetStatus.OFFSET_FOUND_NULL
                cur = min(hi, (cur // cq.per_file + 1) * cq.per_file)
            break
        budget -= len(raw) // CQ_ENTRY.size
        for phy, size, tag in CQ_ENTRY.iter_unpack(raw):
            if size <= 0 or phy < cl_min:  # never written, or its segment was deleted
                if not picked:
                    status = GetStatus.OFFSET_FOUND_NULL
            elif tag_codes is not None and tag not in tag_codes:
                if not picked:
                    status = GetStatus.NO_MATCHED_MESSAGE
            elif picked and total + size > max_bytes:
                full = True
                break
            else:
                picked.append((phy, size, cur))
                total += size
                if len(picked) >= max_count:
                    full = True
                    cur += 1
                    break
            cur += 1
    records = _checked(read_records(cl, picked), picked, cq, damage)
    if records:
        status = GetStatus.FOUND
    elif picked:
        status = GetStatus.OFFSET_FOUND_NULL
    return GetResult(status, records, cur, lo, hi, picked[0][0] if records else -1)


def offset_by_time(cl: CommitLog, cq: ConsumeQueue, ts_ms: int) -> int:
    """RocketMQ's ``getOffsetInQueueByTime`` (its LOWER boundary): the first queue offset
    whose message was stored at or after ``ts_ms`` (epoch ms) — the queue's min offset when
    ``ts_ms`` is before everything, its max offset when nothing was stored since.

    A binary search over the queue's entries, reading each probed message's store time from
    the commit log (store times grow along a queue: they are taken under the write lock).
    An entry that cannot be read (a hole, its segment deleted, a damaged header) counts as
    stored before ``ts_ms``."""
    lo, hi = cq.min_offset, cq.max_offset
    while lo < hi:
        mid = (lo + hi) // 2
        if _store_time(cl, cq, mid) < ts_ms:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _store_time(cl: CommitLog, cq: ConsumeQueue, offset: int) -> int:
    """The store time of the message at ``offset`` of the queue; -1 if it cannot be read."""
    e = cq.entry(offset)
    if e is None or e[1] < HEADER.size:
        return -1
    head = cl.read(e[0], HEADER.size)
    if head is None or PREFIX.unpack_from(head)[1] != MESSAGE_MAGIC:
        return -1
    h = read_header(head)
    return h.store_timestamp if h.commit_log_offset == e[0] else -1


def _checked(
    records: list[bytes | None],
    picked: list[tuple[int, int, int]],
    cq: ConsumeQueue,
    damage: DamageLedger | None,
) -> list[bytes]:
    """The records read that are sound, in order; each damaged one reported."""
    good: list[bytes] = []
    for rec, (phy, size, qoff) in zip(records, picked, strict=True):
        if rec is None:  # its segment went meanwhile (retention)
            continue
        try:
            check_record(rec)
            if read_header(rec).commit_log_offset == phy:
                good.append(rec)
                continue
            why = "the record there names another offset"
        except CorruptRecord as exc:
            why = str(exc)
        if damage is not None:
            damage.report(
                "corrupt record",
                phy,
                size,
                f"{cq.topic}/{cq.queue_id} queue offset {qoff}: {why}; skipped",
            )
    return good


def read_records(cl: CommitLog, picked: list[tuple[int, int, int]]) -> list[bytes | None]:
    """The records at ``(offset, size, ...)`` (None: no longer there); neighbours in one
    segment share one pread."""
    out: list[bytes | None] = []
    ss = cl.segment_size
    n = len(picked)
    i = 0
    while i < n:
        start, size = picked[i][:2]
        end = start + size
        seg = start // ss
        j = i + 1
        while j < n:
            p, s = picked[j][:2]
            if p - end > _READ_GAP or (p + s - 1) // ss != seg or p + s - start > _READ_SPAN:
                break
            end = p + s
            j += 1
        data = cl.read(start, end - start) if j > i + 1 else None
        for k in range(i, j):
            p, s = picked[k][:2]
            if data is not None:
                out.append(data[p - start : p - start + s])
            else:
                out.append(cl.read(p, s))
        i = j
    return out


def query_by_key(
    index: IndexService, cl: CommitLog, key: str, max_num: int, begin_ts: int, end_ts: int
) -> list[bytes]:
    out: list[bytes] = []
    if not key or max_num <= 0:
        return out
    for rec in _candidates(index, cl, key_hash(key), begin_ts, end_ts):
        if key in record_topic_and_props(rec)[1].get(Prop.KEYS, "").split(" "):
            out.append(rec)
            if len(out) >= max_num:
                break
    return out


def query_by_uniq_key(index: IndexService, cl: CommitLog, msg_id: str) -> bytes | None:
    if not msg_id:
        return None
    for rec in _candidates(index, cl, uniq_key_hash(msg_id), 0, 2**63 - 1):
        if record_topic_and_props(rec)[1].get(Prop.UNIQ_KEY) == msg_id:
            return rec
    return None


def query_all_by_uniq_key(
    index: IndexService, cl: CommitLog, msg_id: str, max_num: int
) -> list[bytes]:
    """Every record whose UNIQ_KEY is ``msg_id`` (copies, retries, ...), newest first."""
    out: list[bytes] = []
    if not msg_id or max_num <= 0:
        return out
    for rec in _candidates(index, cl, uniq_key_hash(msg_id), 0, 2**63 - 1):
        if record_topic_and_props(rec)[1].get(Prop.UNIQ_KEY) == msg_id:
            out.append(rec)
            if len(out) >= max_num:
                break
    return out


def _candidates(
    index: IndexService, cl: CommitLog, h: int, begin_ts: int, end_ts: int
) -> Iterator[bytes]:
    """Distinct, CRC-checked records in the index under hash ``h``, newest first."""
    seen: set[int] = set()
    for phy in index.lookup(h, begin_ts, end_ts):
        if phy in seen or phy < cl.min_offset:
            continue
        seen.add(phy)
        rec = cl.read_record(phy)
        if rec is not None and begin_ts <= read_header(rec).store_timestamp <= end_ts:
            yield rec


class StoreReads:
    """The message store's read side (a base of :class:`MessageStore`)."""

    _cl: CommitLog
    _cqs: dict[tuple[str, int], ConsumeQueue]
    _index: IndexService
    damage: DamageLedger

    def get_messages(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_count: int = 32,
        max_bytes: int = 4 * 1024 * 1024,
        tag_codes: set[int] | None = None,
    ) -> GetResult:
        """Up to ``max_count`` records of a queue from ``offset`` (RocketMQ's getMessage)."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None:
            return GetResult(GetStatus.NO_MATCHED_LOGIC_QUEUE, [], 0, 0, 0)
        return get_from_queue(self._cl, cq, offset, max_count, max_bytes, tag_codes, self.damage)

    def min_offset(self, topic: str, queue_id: int) -> int:
        cq = self._cqs.get((topic, queue_id))
        return cq.min_offset if cq is not None else 0

    def max_offset(self, topic: str, queue_id: int) -> int:
        """The next queue offset to be written (0 for an unknown queue)."""
        cq = self._cqs.get((topic, queue_id))
        return cq.max_offset if cq is not None else 0

    def offset_by_time(self, topic: str, queue_id: int, ts_ms: int) -> int:
        """The first offset of the queue whose message was stored at or after ``ts_ms``
        (epoch ms): its min offset if that is before everything, its max offset if
        nothing was stored since (0 for an unknown queue)."""
        cq = self._cqs.get((topic, queue_id))
        return offset_by_time(self._cl, cq, ts_ms) if cq is not None else 0

    def queue_offsets(self) -> dict[str, dict[int, tuple[int, int]]]:
        out: dict[str, dict[int, tuple[int, int]]] = {}
        for (topic, qid), cq in list(self._cqs.items()):
            out.setdefault(topic, {})[qid] = (cq.min_offset, cq.max_offset)
        return out

    def look_message_by_offset(self, commit_log_offset: int) -> bytes | None:
        return self._cl.read_record(commit_log_offset)

    def query_by_key(
        self, key: str, max_num: int = 32, begin_ts: int = 0, end_ts: int = 2**63 - 1
    ) -> list[bytes]:
        """Records whose KEYS contain ``key``, stored in [begin_ts, end_ts], newest first."""
        return query_by_key(self._index, self._cl, key, max_num, begin_ts, end_ts)

    def query_by_uniq_key(self, msg_id: str) -> bytes | None:
        """The record whose UNIQ_KEY (client message id) is ``msg_id``."""
        return query_by_uniq_key(self._index, self._cl, msg_id)

    def query_all_by_uniq_key(self, msg_id: str, max_num: int = 256) -> list[bytes]:
        """Every record whose UNIQ_KEY is ``msg_id`` (copies of one message), newest first."""
        return query_all_by_uniq_key(self._index, self._cl, msg_id, max_num)

    def query_uniq_key_since(self, msg_id: str, begin_ts: int, max_num: int = 64) -> list[bytes]:
        """The records whose UNIQ_KEY is ``msg_id`` stored at or after ``begin_ts`` (ms),
        newest first."""
        out: list[bytes] = []
        for rec in _candidates(self._index, self._cl, uniq_key_hash(msg_id), begin_ts, 2**63 - 1):
            if record_topic_and_props(rec)[1].get(Prop.UNIQ_KEY) == msg_id:
                out.append(rec)
                if len(out) >= max_num:
                    break
        return out

    def key_hashes_since(self, begin_ts: int) -> list[int]:
        """The key-index hashes (``uniq_key_hash`` of each UNIQ_KEY, ``key_hash`` of each
        KEYS entry) of the records stored at or after ``begin_ts`` (ms), oldest first."""
        return self._index.hashes_since(begin_ts)
