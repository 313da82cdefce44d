"""Walking the commit log's records in order, as recovery does.

A walk stops at the log's end.  What lies between valid records — a record whose bytes were
damaged, a segment file missing or cut short — is either the *torn tail* (nothing valid
after it: the writer died mid-write, recovery cuts it off) or damage in the middle, which
the scanner steps over to the next valid record and reports, so that good records after it
are kept.  A record is taken as the next valid one only if its CRC holds and it names its
own commit-log offset.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from txmq.protocol.codec import (
    BLANK_MAGIC,
    MESSAGE_MAGIC,
    MIN_RECORD_SIZE,
    PREFIX,
    CorruptRecord,
    check_record,
    read_header,
)

from .commitlog import CommitLog, Segment
from .types import NAME_WIDTH

__all__ = ["Scanner", "Skipped"]

_SCAN_CHUNK = 4 * 1024 * 1024
_MAGIC = MESSAGE_MAGIC.to_bytes(4, "little")


@dataclass(frozen=True, slots=True)
class Skipped:
    """Bytes of the log between valid records that the scanner stepped over."""

    start: int
    end: int
    why: str


class Scanner:
    """Walks the valid records from ``start`` (up to ``stop``).

    Iterating yields ``(offset, buf, pos, size)`` for each message record (the record is
    ``buf[pos:pos + size]``); blank fillers are skipped.  Afterwards :attr:`end` is the
    offset just past the last valid record, :attr:`error` says why the walk stopped before
    the end of the log (a torn tail), and :attr:`skipped` lists the damage stepped over.
    """

    def __init__(self, commit_log: CommitLog, start: int, stop: int | None = None) -> None:
        self._cl = commit_log
        self.start = start
        self.stop = stop
        self.end = start
        self.error: str | None = None
        self.skipped: list[Skipped] = []

    def __iter__(self) -> Iterator[tuple[int, bytes, int, int]]:
        cl = self._cl
        ss = cl.segment_size
        by_start = {s.start: s for s in cl.segments()}
        if not by_start:
            return
        last_start = max(by_start)
        stop = self.stop if self.stop is not None else 1 << 63
        pos = self.start
        while pos < stop:
            seg_start = pos - pos % ss
            seg = by_start.get(seg_start)
            if seg is None:
                later = [s for s in by_start if s > seg_start]
                if not later:
                    return
                nxt = min(later)
                self._skip(pos, nxt, f"segment file {seg_start:0{NAME_WIDTH}d} is missing")
                pos = nxt
                continue
            flen = os.fstat(seg.fd).st_size
            off = pos - seg_start
            is_last = seg_start == last_start
            for found in self._records(seg, off, flen, stop):
                if not isinstance(found, Skipped):
                    yield found
                    self.end = found[0] + found[3]
                    continue
                bad_at, why = found.start, found.why
                resume = _next_record(seg, bad_at - seg_start + 1, flen)
                if resume is not None:
                    self._skip(bad_at, seg_start + resume, why)
                    pos = seg_start + resume
                    break
                if is_last:  # nothing valid after it: a torn tail
                    self._tail(bad_at, why)
                    return
                self._skip(bad_at, seg_start + ss, f"{why}, to the end of the segment")
                pos = seg_start + ss
                break
            else:
                if seg_start + flen >= stop:
                    return
                if flen >= ss:  # a sealed segment ends in its blank filler
                    pos = self.end = seg_start + ss
                    continue
                if is_last:
                    return
                self._skip(
                    seg_start + flen,
                    seg_start + ss,
                    f"segment file {seg_start:0{NAME_WIDTH}d} is {ss - flen} bytes short",
                )
                pos = seg_start + ss

    def _tail(self, at: int, why: str) -> None:
        """The log is sound up to ``at``: what was skipped right before it is tail too."""
        while self.skipped and self.skipped[-1].end == at:
            at = self.skipped.pop().start
        self.error = why
        self.end = at

    def _skip(self, start: int, end: int, why: str) -> None:
        self.skipped.append(Skipped(start, end, why))
        self.end = end

    def _records(
        self, seg: Segment, off: int, flen: int, stop: int
    ) -> Iterator[tuple[int, bytes, int, int] | Skipped]:
        """The records of one segment from ``off``: ``(offset, buf, pos, size)`` each, then
        a :class:`Skipped` (its end unknown yet) if it stops at something not a record."""
        ss = self._cl.segment_size
        seg_start = seg.start
        buf = b""
        bstart = off
        while off < flen and seg_start + off < stop:
            if flen - off < PREFIX.size:
                yield _bad(seg_start + off, f"partial record ({flen - off} bytes)")
                return
            if off + PREFIX.size > bstart + len(buf):
                buf = os.pread(seg.fd, _SCAN_CHUNK, off)
                bstart = off
            total, magic = PREFIX.unpack_from(buf, off - bstart)
            if magic == BLANK_MAGIC:
                if off + total != ss or flen != ss:
                    yield _bad(seg_start + off, "bad blank filler")
                return
            if magic != MESSAGE_MAGIC:
                yield _bad(seg_start + off, f"garbage (bad magic {magic:#010x})")
                return
            if total < MIN_RECORD_SIZE or off + total + PREFIX.size > ss:
                yield _bad(seg_start + off, f"garbage (bad record size {total})")
                return
            if off + total > flen:
                yield _bad(seg_start + off, f"partial record ({flen - off} of {total} bytes)")
                return
            if off + total > bstart + len(buf):
                buf = os.pread(seg.fd, max(_SCAN_CHUNK, total), off)
                bstart = off
            try:
                check_record(buf, off - bstart)
            except CorruptRecord as exc:
                yield _bad(seg_start + off, f"corrupt record: {exc}")
                return
            yield seg_start + off, buf, off - bstart, total
            off += total


def _bad(at: int, why: str) -> Skipped:
    return Skipped(at, at, why)


def _next_record(seg: Segment, off: int, flen: int) -> int | None:
    """The position of the first sound record at or after ``off`` in ``seg``: its CRC
    holds and it names its own commit-log offset (None: there is none)."""
    while off < flen:
        chunk = os.pread(seg.fd, _SCAN_CHUNK + PREFIX.size, off)
        if not chunk:
            return None
        i = chunk.find(_MAGIC, 4)
        while i >= 0:
            cand = off + i - 4
            if _sound(seg, cand, flen):
                return cand
            i = chunk.find(_MAGIC, i + 1)
        off += _SCAN_CHUNK
    return None


def _sound(seg: Segment, off: int, flen: int) -> bool:
    head = os.pread(seg.fd, PREFIX.size, off)
    if len(head) < PREFIX.size:
        return False
    total = PREFIX.unpack(head)[0]
    if total < MIN_RECORD_SIZE or off + total > flen:
        return False
    rec = os.pread(seg.fd, total, off)
    try:
        check_record(rec)
    except CorruptRecord:
        return False
    return bool(read_header(rec).commit_log_offset == seg.start + off)
