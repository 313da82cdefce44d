"""Consume queues: per (topic, queue id), fixed 20-byte entries pointing into the commit log.

Entry ``n`` of a queue (its *queue offset*) is ``commit-log offset (8), size (4), tag code
(8)``, little-endian.  Files hold ``cq_entries_per_file`` entries each and are named by the
byte position of their first entry (RocketMQ's naming).  A file is created at full size
(sparse) and memory-mapped, so appending an entry is a store into the map and readers see
it at once; the flush thread msyncs the written range.  Disk blocks are reserved ahead of
the entries, a chunk at a time (:meth:`ConsumeQueue.reserve`): storing into a hole of a
full disk would kill the process with SIGBUS, a failed reservation is a
:class:`~.disk.DiskFullError`.  Everything at or past a queue's max
offset is zero, and an entry of size 0 is a hole (never written).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from pathlib import Path

from .commitlog import fsync_dir
from .disk import ALLOC_CHUNK, allocate
from .types import NAME_WIDTH, StoreError

__all__ = ["CQ_ENTRY", "ConsumeQueue", "CqFile"]

CQ_ENTRY = struct.Struct("<qiq")  # commit-log offset, size, tag code
ENTRY = CQ_ENTRY.size
_PAGE = mmap.PAGESIZE

log = logging.getLogger("txmq.broker.store")


def map_file(fd: int, size: int) -> mmap.mmap:
    """Map a (sparse) file for random access.

    Without MADV_RANDOM the first fault on a fresh sparse file reads ahead (and zeroes) a
    large window, which was measured to take ~15 ms per file.
    """
    mm = mmap.mmap(fd, size)
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_RANDOM)
    return mm


def _data_end(path: Path, size: int) -> int:
    """An upper bound of the file's written bytes: the end of its last data extent."""
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = end = 0
        while pos < size:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data past pos
                break
            end = pos = os.lseek(fd, data, os.SEEK_HOLE)
        return min(end, size)
    finally:
        os.close(fd)


class CqFile:
    __slots__ = ("allocated", "end", "index", "mm", "path", "start")

    def __init__(self, path: Path, index: int, per_file: int) -> None:
        size = per_file * ENTRY
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            have = os.fstat(fd).st_size
            if have > size:
                raise StoreError(
                    f"consume-queue file {path} holds {have} bytes, more than "
                    f"cq_entries_per_file * 20 = {size}; was it written with another setting?"
                )
            if have < size:
                os.ftruncate(fd, size)
            self.mm = map_file(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.index = index
        self.start = index * per_file
        self.end = self.start + per_file
        #: bytes from the file's start whose disk blocks are reserved
        self.allocated = 0

    def reserve(self, upto: int) -> None:
        """Make sure the disk blocks of the file's first ``upto`` bytes are allocated
        (:class:`~.disk.DiskFullError` if the disk has no room)."""
        if upto <= self.allocated:
            return
        size = len(self.mm)
        hi = min(size, -(-upto // ALLOC_CHUNK) * ALLOC_CHUNK)
        allocate(self.path, self.allocated, hi - self.allocated)
        self.allocated = hi


class ConsumeQueue:
    def __init__(self, root: Path, topic: str, queue_id: int, per_file: int) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.dir = root / topic / str(queue_id)
        self.per_file = per_file
        self.files: dict[int, CqFile] = {}
        self.last: CqFile | None = None
        self.min_offset = 0
        self.max_offset = 0
        #: entries below this are msynced
        self.flushed = 0
        self.dir_dirty = False

    # -- loading ---------------------------------------------------------------------------

    def load(self, expected_max: int | None) -> None:
        """Open the queue's files and find its max offset.

        ``expected_max`` (from a clean shutdown's checkpoint) allows a quick check of the
        tail; otherwise the last file is scanned for its last non-zero byte.
        """
        per = self.per_file
        found: dict[int, Path] = {}
        for path in self.dir.iterdir():
            name = path.name
            if len(name) == NAME_WIDTH and name.isdigit() and int(name) % (per * ENTRY) == 0:
                found[int(name) // (per * ENTRY)] = path
            else:
                log.warning("consume queue: ignoring unexpected file %s", path)
        prev: int | None = None
        for idx in sorted(found):
            if prev is not None and idx != prev + 1:
                # a missing file in the middle: what follows cannot be trusted
                for later in sorted(found):
                    if later >= idx:
                        found[later].unlink()
                break
            self.files[idx] = CqFile(found[idx], idx, per)
            prev = idx
        if not self.files:
            return
        self.last = self.files[max(self.files)]
        first = self.files[min(self.files)]
        self.min_offset = first.start
        if expected_max is not None and self._tail_is(expected_max):
            self.max_offset = expected_max
        else:
            valid, self.max_offset = self._scan_max()
            self._cut(valid)  # zero a trailing partial or never-completed entry
        self.flushed = self.max_offset

    def _tail_is(self, m: int) -> bool:
        last = self.last
        if last is None or not (last.start < m <= last.end):
            return False
        e = self.entry(m - 1)
        if e is None or e[1] == 0:
            return False
        pos = (m - last.start) * ENTRY
        return m == last.end or last.mm[pos : pos + ENTRY] == bytes(ENTRY)

    def _scan_max(self) -> tuple[int, int]:
        """(one past the last real entry, one past the last entry with any non-zero byte)."""
        for idx in sorted(self.files, reverse=True):
            f = self.files[idx]
            end = _data_end(f.path, len(f.mm))
            while end > 0:
                lo = max(0, end - 65536)
                used = len(f.mm[lo:end].rstrip(b"\0"))
                if used:
                    end = lo + used
                    break
                end = lo
            dirty = m = f.start + -(-end // ENTRY)
            while m > f.start:
                e = self.entry(m - 1)
                if e is not None and e[1] != 0:
                    return m, dirty
                m -= 1
            if dirty > f.start:
                return f.start, dirty
        start = min(self.files) * self.per_file if self.files else 0
        return start, start

    # -- entries ---------------------------------------------------------------------------

    def entry(self, offset: int) -> tuple[int, int, int] | None:
        f = self.files.get(offset // self.per_file)
        if f is None:
            return None
        phy, size, tag = CQ_ENTRY.unpack_from(f.mm, (offset - f.start) * ENTRY)
        return phy, size, tag

    def read(self, offset: int, count: int) -> bytes:
        """Up to ``count`` raw entries from ``offset`` (below max, within one file)."""
        hi = self.max_offset
        f = self.files.get(offset // self.per_file)
        if f is None or offset >= hi:
            return b""
        end = min(offset + count, hi, f.end)
        return f.mm[(offset - f.start) * ENTRY : (end - f.start) * ENTRY]

    def reserve(self, offset: int) -> None:
        """Allocate the disk blocks entry ``offset`` goes to (creating its file): after
        this :meth:`put` at ``offset`` cannot fail for want of space."""
        f = self.last
        if f is None or not f.start <= offset < f.end:
            f = self._file_for_write(offset)
        f.reserve((offset - f.start + 1) * ENTRY)

    def put(self, offset: int, phy: int, size: int, tag: int) -> None:
        f = self.last
        if f is None or not f.start <= offset < f.end:
            f = self._file_for_write(offset)
        at = (offset - f.start) * ENTRY
        if at + ENTRY > f.allocated:
            f.reserve(at + ENTRY)
        CQ_ENTRY.pack_into(f.mm, at, phy, size, tag)
        if offset >= self.max_offset:
            if self.max_offset == 0 and offset and self.min_offset == 0:
                self.min_offset = offset
            self.max_offset = offset + 1

    def _file_for_write(self, offset: int) -> CqFile:
        idx = offset // self.per_file
        f = self.files.get(idx)
        if f is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"{idx * self.per_file * ENTRY:0{NAME_WIDTH}d}"
            f = CqFile(path, idx, self.per_file)
            files = dict(self.files)
            files[idx] = f
            self.files = files
            self.dir_dirty = True
        if self.last is None or f.index >= self.last.index:
            self.last = f
        return f

    def _first_at_or_above(self, phy: int) -> int:
        """The first queue offset whose entry is real and points at or above ``phy``."""
        if not self.files:
            return self.max_offset
        lo = min(self.files) * self.per_file
        hi = self.max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            e = self.entry(mid)
            if e is None or e[1] == 0 or e[0] < phy:
                lo = mid + 1
            else:
                hi = mid
        return lo

    # -- truncation and retention ----------------------------------------------------------

    def raw_at_or_above(self, phy: int) -> tuple[int, bytes]:
        """The entries pointing at or above commit-log offset ``phy`` (what
        :meth:`truncate_phy` drops), raw (:data:`CQ_ENTRY` each), and the first's queue
        offset."""
        first = q = self._first_at_or_above(phy)
        parts = []
        while q < self.max_offset:
            f = self.files.get(q // self.per_file)
            if f is None:
                break
            hi = min(self.max_offset, f.end)
            parts.append(bytes(f.mm[(q - f.start) * ENTRY : (hi - f.start) * ENTRY]))
            q = hi
        return first, b"".join(parts)

    def truncate_phy(self, phy: int, upper: int | None = None) -> int:
        """Drop every entry pointing at or above commit-log offset ``phy``; return how many.

        ``upper``, when known, bounds the entries that can point below ``phy``.
        """
        hi = self.max_offset
        last = self.entry(hi - 1) if hi > 0 else None
        below = last is not None and last[1] != 0 and last[0] < phy
        if hi == 0 or (below and (upper is None or hi <= upper)):
            return 0  # the newest entry points below phy, so all do
        new_max = self._first_at_or_above(phy)
        if upper is not None and upper < new_max:
            new_max = max(upper, min(self.files) * self.per_file if self.files else 0)
        dropped = self.max_offset - new_max
        if dropped > 0:
            self._cut(new_max)
        return max(dropped, 0)

    def _cut(self, new_max: int) -> None:
        """Make ``new_max`` the max offset: zero the entries from it to the old max offset
        (everything past that is zero already) and remove later files."""
        for idx in sorted(self.files):
            f = self.files[idx]
            if f.start >= new_max and f.start > 0:
                del self.files[idx]
                f.mm.close()
                f.path.unlink()
                self.dir_dirty = True
            elif f.end > new_max and self.max_offset > new_max:
                a = (max(new_max, f.start) - f.start) * ENTRY
                b = (min(self.max_offset, f.end) - f.start) * ENTRY
                if b > a:
                    f.mm[a:b] = bytes(b - a)
                    a -= a % _PAGE
                    f.mm.flush(a, b - a)
        self.last = self.files[max(self.files)] if self.files else None
        self.max_offset = new_max
        self.min_offset = min(self.min_offset, new_max)
        self.flushed = min(self.flushed, new_max)

    def correct_min(self, cl_min: int) -> None:
        """Move the min offset to the first entry still pointing into the commit log."""
        if self.files:
            first = min(self.files) * self.per_file
            e = self.entry(first) if first < self.max_offset else None
            if e is not None and e[1] and e[0] >= cl_min:
                self.min_offset = first
                return
        self.min_offset = self._first_at_or_above(cl_min)

    def expired_files(self, cl_min: int) -> list[CqFile]:
        """Files (never the last one) whose every entry points below ``cl_min``."""
        out: list[CqFile] = []
        for idx in sorted(self.files)[:-1]:
            f = self.files[idx]
            e = self.entry(f.end - 1)
            if e is None or e[0] >= cl_min:
                break
            out.append(f)
        return out

    def forget(self, victims: list[CqFile]) -> None:
        gone = {f.index for f in victims}
        self.files = {k: v for k, v in self.files.items() if k not in gone}

    # -- flushing --------------------------------------------------------------------------

    def flush(self) -> None:
        if self.dir_dirty:
            self.dir_dirty = False
            for d in (self.dir, self.dir.parent, self.dir.parent.parent):
                fsync_dir(d)
        lo, hi = self.flushed, self.max_offset
        if hi <= lo:
            return
        per = self.per_file
        for idx in range(lo // per, (hi - 1) // per + 1):
            f = self.files.get(idx)
            if f is None:
                continue
            a = (max(lo, f.start) - f.start) * ENTRY
            b = (min(hi, f.end) - f.start) * ENTRY
            a -= a % _PAGE
            f.mm.flush(a, b - a)
        self.flushed = hi

    def close(self) -> None:
        for f in self.files.values():
            f.mm.close()
        self.files = {}
        self.last = None
