"""Start-up recovery: validate the commit log's tail and rebuild what depends on it.

1. The checkpoint says below which commit-log offset everything is durable and dispatched.
2. Consume queues and index files are opened; every entry pointing at or past the scan
   start is dropped (with a partial or never-written trailing entry).
3. Queues holding fewer entries than the checkpoint recorded (files deleted or truncated)
   are rebuilt from the commit log, from just after their last surviving entry.
4. The commit log is scanned from the checkpoint, each record checked (magic, size, CRC)
   and dispatched again.  Damage with sound records after it is stepped over and kept
   (those records are dispatched); only a torn tail, with nothing sound after it, is cut.
5. Whatever is missing — segment files, bytes the checkpoint says were written, records
   that consume-queue entries dropped in step 2 pointed at past the scanned log's end (the
   newest segment deleted or cut: those messages had been stored and acknowledged) — is a
   WARNING and an entry in the store's damage ledger (``txmq admin broker-info``).
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from txmq.protocol.codec import HEADER, read_header, record_topic_and_props
from txmq.protocol.message import Prop, tag_hash

from .checkpoint import Checkpoint, read_checkpoint
from .commitlog import CommitLog
from .consumequeue import CQ_ENTRY, ConsumeQueue
from .damage import DamageLedger
from .index import IndexService, key_hash, uniq_key_hash
from .scanner import Scanner
from .types import RecoveryStats

__all__ = ["CQ_TAG_PROPERTY", "Recovery", "index_keys", "tag_code_of"]

log = logging.getLogger("txmq.broker.store")

#: property holding an explicit consume-queue tag code (put's ``cq_tag_code``, e.g. the
#: delivery time of a delayed message) so that recovery can dispatch it again
CQ_TAG_PROPERTY = Prop.CQ_TAG_CODE

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_BODY_LEN_AT = HEADER.size - 4


def tag_code_of(props: dict[str, str]) -> int:
    explicit = props.get(CQ_TAG_PROPERTY)
    if explicit is not None:
        try:
            return int(explicit)
        except ValueError:
            pass
    return tag_hash(props.get(Prop.TAGS))


def index_keys(index: IndexService, props: dict[str, str], phy: int, ts: int) -> None:
    """Add the key-index entries of one record (its UNIQ_KEY and each of its KEYS)."""
    uniq = props.get(Prop.UNIQ_KEY)
    if uniq:
        index.put(uniq_key_hash(uniq), phy, ts)
    keys = props.get(Prop.KEYS)
    if keys:
        if " " in keys:
            for key in dict.fromkeys(keys.split(" ")):
                if key:
                    index.put(key_hash(key), phy, ts)
        else:
            index.put(key_hash(keys), phy, ts)


def _topic_of(buf: bytes, pos: int) -> str:
    p = pos + HEADER.size + _U32.unpack_from(buf, pos + _BODY_LEN_AT)[0]
    (tlen,) = _U16.unpack_from(buf, p)
    return buf[p + 2 : p + 2 + tlen].decode()


@dataclass
class Recovery:
    root: Path
    commit_log: CommitLog
    index: IndexService
    cq_root: Path
    cq_entries_per_file: int
    cqs: dict[tuple[str, int], ConsumeQueue]
    damage: DamageLedger
    #: the entries step 2 dropped that point into the newest segment or past it, per
    #: queue: the first's queue offset, and the entries raw
    _dropped: dict[tuple[str, int], tuple[int, bytes]] = field(default_factory=dict, init=False)

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        cq = self.cqs.get((topic, queue_id))
        if cq is None:
            cq = ConsumeQueue(self.cq_root, topic, queue_id, self.cq_entries_per_file)
            self.cqs[(topic, queue_id)] = cq
        return cq

    def run(self, clean: bool) -> RecoveryStats:
        t0 = time.perf_counter()
        cl = self.commit_log
        ckpt = read_checkpoint(self.root / "checkpoint")
        cl.load()
        cl_min = cl.min_offset
        disk_end = cl.disk_end()
        gaps = cl.gaps()
        for start, end, why in gaps:
            kind = "missing segment" if "missing" in why else "short segment"
            self.damage.report(kind, start, end - start, f"{why}; its records are lost")
        short = None
        if ckpt is not None and ckpt.offset > disk_end:
            short = ckpt.offset  # reported with what the queues say is lost, after the scan
            ckpt = None
        scan_from = cl_min if ckpt is None else max(ckpt.offset, cl_min)
        trusted = clean and ckpt is not None
        segments = cl.segments()
        newest = max(scan_from, segments[-1].start if segments else 0)
        self._load_queues(ckpt, scan_from, trusted, newest)
        self.index.load()
        self.index.truncate(scan_from, trust_slots=trusted)
        redispatched = self._rebuild_damaged(ckpt, scan_from)

        scanner = Scanner(cl, scan_from)
        for phy, buf, pos, size in scanner:
            self._dispatch(buf, pos, phy, size, with_index=True)
            redispatched += 1
        self._report_skipped(scanner, {g[0] for g in gaps})
        self._report_lost_tail(scanner.end, short)
        truncated = 0
        if scanner.error is not None:
            truncated = cl.truncate(scanner.end)
            log.warning(
                "commit log: truncated %d bytes at offset %d (%s)",
                truncated,
                scanner.end,
                scanner.error,
            )
        for cq in self.cqs.values():
            cq.correct_min(cl.min_offset)
        return RecoveryStats(
            scanned_from=scan_from,
            redispatched=redispatched,
            truncated_bytes=truncated,
            clean=clean,
            took_ms=(time.perf_counter() - t0) * 1000,
        )

    def _load_queues(
        self, ckpt: Checkpoint | None, scan_from: int, trusted: bool, newest: int
    ) -> None:
        """Open every queue and drop its entries at or past ``scan_from``, keeping aside
        those at or past ``newest`` (the newest segment's start) for
        :meth:`_report_lost_tail`."""
        self.cq_root.mkdir(parents=True, exist_ok=True)
        for topic_dir in sorted(self.cq_root.iterdir()):
            if not topic_dir.is_dir():
                continue
            for qdir in sorted(topic_dir.iterdir()):
                if not qdir.name.isdigit() or not qdir.is_dir():
                    continue
                key = (topic_dir.name, int(qdir.name))
                cq = self.queue(*key)
                expected = ckpt.queues.get(key) if ckpt is not None else None
                cq.load(expected if trusted else None)
                # entries past the checkpoint's count point past it, whatever they say
                upper = ckpt.queues.get(key, 0) if ckpt is not None else None
                first, raw = cq.raw_at_or_above(newest)
                if raw:
                    self._dropped[key] = (first, raw)
                cq.truncate_phy(scan_from, upper)

    def _rebuild_damaged(self, ckpt: Checkpoint | None, scan_from: int) -> int:
        """Re-create consume-queue entries lost below the checkpoint (deleted/cut files)."""
        if ckpt is None:
            return 0
        cl_min = self.commit_log.min_offset
        damaged: set[tuple[str, int]] = set()
        start = scan_from
        for key, expected in ckpt.queues.items():
            cq = self.queue(*key)
            have = cq.max_offset
            if have >= expected:
                continue
            damaged.add(key)
            last = cq.entry(have - 1) if have > 0 else None
            begin = last[0] + last[1] if last is not None and last[1] else cl_min
            start = min(start, max(begin, cl_min))
            log.warning(
                "consume queue %s/%d has %d entries, the checkpoint recorded %d; "
                "rebuilding it from the commit log",
                key[0],
                key[1],
                have,
                expected,
            )
        if not damaged or start >= scan_from:
            return 0
        count = 0
        scanner = Scanner(self.commit_log, start, stop=scan_from)
        for phy, buf, pos, size in scanner:
            key = (_topic_of(buf, pos), read_header(buf, pos).queue_id)
            if key in damaged:
                count += self._dispatch(buf, pos, phy, size, with_index=False)
        self._report_skipped(scanner, set())
        if scanner.error is not None:
            log.error(
                "commit log below the checkpoint is unreadable at offset %d (%s); "
                "consume queues were rebuilt only up to there",
                scanner.end,
                scanner.error,
            )
        return count

    def _report_lost_tail(self, end: int, short_of: int | None) -> None:
        """One finding for the records lost at the log's tail: the consume-queue entries
        step 2 dropped that point at or past the scanned log's ``end`` (an entry is made
        only after its record is written, so those records were stored, and acknowledged,
        and are gone), and ``short_of``: the checkpoint's offset when the log ends before
        it."""
        lost: dict[tuple[str, int], tuple[int, int]] = {}  # queue -> first, last offset
        count, top = 0, end
        for key, (first, raw) in sorted(self._dropped.items()):
            for i, (phy, size, _) in enumerate(CQ_ENTRY.iter_unpack(raw)):
                if phy >= end and size:
                    count += 1
                    top = max(top, phy + size)
                    lo, _ = lost.get(key, (first + i, 0))
                    lost[key] = (lo, first + i)
        self._dropped.clear()
        if short_of is not None:
            top = max(top, short_of)
        elif not count:
            return
        queues = [f"{t}/{q} queue offsets {lo}-{hi}" for (t, q), (lo, hi) in lost.items()]
        more = f" and {len(queues) - 5} more queues" if len(queues) > 5 else ""
        where = f" ({'; '.join(queues[:5])}{more})" if queues else ""
        why = (
            f"the checkpoint says {short_of} bytes were written and flushed"
            if short_of is not None
            else "consume-queue entries point past it"
        )
        self.damage.report(
            "commit log short of checkpoint" if short_of is not None else "commit log cut",
            end,
            top - end,
            f"the commit log ends at {end} but {why}: acknowledged messages are lost, "
            f"{count} known from the consume queues{where} (a segment file deleted or cut?)",
            lost=count,
        )

    def _report_skipped(self, scanner: Scanner, known: set[int]) -> None:
        for skip in scanner.skipped:
            if skip.start not in known:
                self.damage.report(
                    "skipped at recovery",
                    skip.start,
                    skip.end - skip.start,
                    f"{skip.why}; the sound records after it are kept",
                )

    def _dispatch(self, buf: bytes, pos: int, phy: int, size: int, *, with_index: bool) -> int:
        head = read_header(buf, pos)
        topic, props = record_topic_and_props(buf, pos)
        cq = self.queue(topic, head.queue_id)
        if head.queue_offset < cq.max_offset and not with_index:
            return 0
        cq.put(head.queue_offset, phy, size, tag_code_of(props))
        if with_index:
            index_keys(self.index, props, phy, head.store_timestamp)
        return 1
