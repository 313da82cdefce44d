"""The commit log: one append-only byte stream in fixed-size segment files.

A segment is named by its start offset (20 digits) and covers ``segment_size`` bytes of
the stream.  Records never straddle segments: when the next record does not fit, the rest
of the segment is filled with a blank record (at least 8 bytes are always left for it) and
writing continues in the next segment.  Files grow as they are written (no preallocation),
so a segment file's length is the amount written to it.

Writes use ``os.pwrite`` under the store's lock; reads use ``os.pread`` and never go past
``write_pos``, which is advanced only after a write completed.  The segment table is
copied on change, so readers work on a consistent snapshot; a deleted segment's file
descriptor is closed when the last reader drops its reference to the segment.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from pathlib import Path

from txmq.protocol.codec import (
    MESSAGE_MAGIC,
    PREFIX,
    CorruptRecord,
    blank_record,
    check_record,
)

from .types import NAME_WIDTH, StoreError

__all__ = ["CommitLog", "Segment", "fsync_dir", "is_segment_name", "segment_paths"]

log = logging.getLogger("txmq.broker.store")


def is_segment_name(name: str) -> bool:
    """Whether ``name`` names a segment file: its start offset, zero-padded."""
    return len(name) == NAME_WIDTH and name.isdigit()


def segment_paths(directory: Path) -> list[Path]:
    """The segment files in a commit-log ``directory``, oldest first (FileNotFoundError if
    there is no such directory)."""
    return sorted(p for p in directory.iterdir() if is_segment_name(p.name))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset``; on failure cut the file back and raise."""
    done = 0
    try:
        done = os.pwrite(fd, data, offset)
        while done < len(data):
            n = os.pwrite(fd, memoryview(data)[done:], offset + done)
            if n <= 0:
                raise OSError("short write")
            done += n
    except OSError as exc:
        try:
            os.ftruncate(fd, offset)
        except OSError:
            pass
        raise StoreError(f"commit log write failed: {exc}") from exc


class Segment:
    """One segment file, open for reading and writing."""

    __slots__ = ("fd", "last_ts", "path", "start")

    def __init__(self, start: int, path: Path, fd: int, last_ts: int) -> None:
        self.start = start
        self.path = path
        self.fd = fd
        #: store timestamp (ms) of the newest record; the file's mtime for segments found on disk
        self.last_ts = last_ts

    def close(self) -> None:
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            self.fd = -1
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class CommitLog:
    def __init__(self, directory: Path, segment_size: int) -> None:
        self.dir = directory
        self.segment_size = segment_size
        self._segs: dict[int, Segment] = {}
        self._cur: Segment | None = None
        self._cur_end = 0
        #: offset of the first byte still on disk
        self.min_offset = 0
        #: offset just past the last completely written byte
        self.write_pos = 0
        #: a segment file was created or removed since the directory was last fsynced
        self.dir_dirty = False

    # -- opening ---------------------------------------------------------------------------

    def load(self) -> None:
        """Open every segment file found; the caller then scans and truncates."""
        self.dir.mkdir(parents=True, exist_ok=True)
        ss = self.segment_size
        segs: dict[int, Segment] = {}
        for path in sorted(self.dir.iterdir()):
            name = path.name
            if not is_segment_name(name):
                log.warning("commit log: ignoring unexpected file %s", path)
                continue
            start = int(name)
            if start % ss:
                raise StoreError(
                    f"commit-log segment {path} does not start at a multiple of segment_size "
                    f"{ss}; was the store created with another segment size?"
                )
            fd = os.open(path, os.O_RDWR)
            st = os.fstat(fd)
            if st.st_size > ss:
                os.close(fd)
                raise StoreError(
                    f"commit-log segment {path} holds {st.st_size} bytes, more than "
                    f"segment_size {ss}; was the store created with another segment size?"
                )
            segs[start] = Segment(start, path, fd, st.st_mtime_ns // 1_000_000)
        self._segs = segs
        if segs:
            first = min(segs)
            last = segs[max(segs)]
            self.min_offset = first
            self._set_current(last, last.start + os.fstat(last.fd).st_size)
        else:
            self._new_segment(0)
            self.min_offset = 0
            self.write_pos = 0

    def _set_current(self, seg: Segment, write_pos: int) -> None:
        self._cur = seg
        self._cur_end = seg.start + self.segment_size
        self.write_pos = write_pos

    def _new_segment(self, start: int) -> Segment:
        path = self.dir / f"{start:0{NAME_WIDTH}d}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        seg = Segment(start, path, fd, 0)
        segs = dict(self._segs)
        segs[start] = seg
        self._segs = segs
        self.dir_dirty = True
        self._set_current(seg, start)
        return seg

    def restart_at(self, start: int) -> None:
        """Make an empty log begin at ``start`` (a segment start) instead of 0."""
        for seg in self._segs.values():
            seg.close()
            seg.path.unlink(missing_ok=True)
        self._segs = {}
        self._new_segment(start)
        self.min_offset = start

    def segments(self) -> list[Segment]:
        return [self._segs[s] for s in sorted(self._segs)]

    def disk_end(self) -> int:
        segs = self.segments()
        if not segs:
            return self.min_offset
        last = segs[-1]
        return last.start + os.fstat(last.fd).st_size

    def gaps(self) -> list[tuple[int, int, str]]:
        """Holes between the oldest and the newest segment: ``(start, end, why)`` for each
        segment file missing, and each sealed one shorter than a segment."""
        ss = self.segment_size
        segs = self.segments()
        out: list[tuple[int, int, str]] = []
        for seg, nxt in itertools.pairwise(segs):
            size = os.fstat(seg.fd).st_size
            if size < ss:
                why = f"segment {seg.path.name} is {ss - size} bytes short of {ss}"
                out.append((seg.start + size, seg.start + ss, why))
            for start in range(seg.start + ss, nxt.start, ss):
                out.append((start, start + ss, f"segment file {start:0{NAME_WIDTH}d} is missing"))
        return out

    # -- writing (callers hold the store lock) ---------------------------------------------

    def fits(self, size: int) -> bool:
        return self.write_pos + size + PREFIX.size <= self._cur_end

    def append(self, data: bytes, last_ts: int) -> None:
        seg = self._cur
        assert seg is not None
        pos = self.write_pos
        _pwrite_all(seg.fd, data, pos - seg.start)
        if last_ts:  # (0: no record with a time, a blank alone: the segment's time stays)
            seg.last_ts = last_ts
        self.write_pos = pos + len(data)

    def roll(self) -> None:
        """Fill the rest of the current segment with a blank record and start the next one."""
        seg = self._cur
        assert seg is not None
        end = self._cur_end
        rest = end - self.write_pos
        if rest > 0:
            _pwrite_all(seg.fd, blank_record(rest), self.write_pos - seg.start)
            self.write_pos = end
        self._new_segment(end)

    # -- reading ---------------------------------------------------------------------------

    def read(self, pos: int, size: int) -> bytes | None:
        """``size`` bytes at ``pos`` if they are completely written and still on disk."""
        if pos < self.min_offset or pos + size > self.write_pos or size <= 0:
            return None
        off = pos % self.segment_size
        seg = self._segs.get(pos - off)
        if seg is None or off + size > self.segment_size:
            return None
        try:
            data = os.pread(seg.fd, size, off)
        except OSError:
            return None
        return data if len(data) == size else None

    def read_record(self, pos: int) -> bytes | None:
        """The CRC-checked record starting at ``pos``, or None."""
        head = self.read(pos, PREFIX.size)
        if head is None:
            return None
        total, magic = PREFIX.unpack(head)
        if magic != MESSAGE_MAGIC:
            return None
        data = self.read(pos, total)
        if data is None:
            return None
        try:
            if check_record(data) != total:
                return None
        except CorruptRecord:
            return None
        return data

    # -- flushing --------------------------------------------------------------------------

    def fsync_range(self, lo: int, hi: int) -> None:
        """fdatasync every segment holding bytes of [lo, hi), and the directory if needed."""
        if self.dir_dirty:
            self.dir_dirty = False
            fsync_dir(self.dir)
        ss = self.segment_size
        start = max(lo, self.min_offset)
        start -= start % ss
        segs = self._segs
        while start < hi:
            seg = segs.get(start)
            if seg is not None and seg.fd >= 0:
                os.fdatasync(seg.fd)
            start += ss

    # -- truncation and retention ----------------------------------------------------------

    def truncate(self, pos: int) -> int:
        """Cut the log at ``pos`` (dropping later segments); return the bytes removed."""
        ss = self.segment_size
        removed = 0
        keep: dict[int, Segment] = {}
        for start in sorted(self._segs):
            seg = self._segs[start]
            length = os.fstat(seg.fd).st_size
            if start > pos:
                removed += length
                seg.close()
                seg.path.unlink()
                continue
            if start + length > pos:
                removed += start + length - pos
                os.ftruncate(seg.fd, pos - start)
                os.fsync(seg.fd)
            keep[start] = seg
        self._segs = keep
        fsync_dir(self.dir)
        if keep:
            last = keep[max(keep)]
            self._set_current(last, min(pos, last.start + ss))
        else:
            self._new_segment(pos - pos % ss)
        return removed

    def expired_segments(self, cutoff_ms: int) -> list[Segment]:
        """The oldest segments (never the newest) whose newest record is older than cutoff."""
        segs = self.segments()[:-1]
        out: list[Segment] = []
        for seg in segs:
            if seg.last_ts >= cutoff_ms:
                break
            out.append(seg)
        return out

    def drop_segments(self, victims: list[Segment], lock: threading.Lock) -> None:
        """Forget and unlink ``victims`` (the oldest segments)."""
        if not victims:
            return
        gone = {s.start for s in victims}
        with lock:
            segs = {k: v for k, v in self._segs.items() if k not in gone}
            self._segs = segs
            self.min_offset = min(segs)
        for seg in victims:
            try:
                seg.path.unlink()
            except FileNotFoundError:
                pass
        fsync_dir(self.dir)

    def close(self) -> None:
        for seg in self._segs.values():
            seg.close()
