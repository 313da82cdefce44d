"""The key index: on-disk hash files in the spirit of RocketMQ's ``IndexFile``.

A file is memory-mapped and laid out as

    header   56 bytes   magic, version, slot count, entry capacity, begin/end store
                        timestamp (ms), begin/end commit-log offset, entry count
    slots    4 * S      per hash slot, the number (1-based) of the newest entry in it
    entries  20 * N     key hash (4), commit-log offset (8), seconds since the file's
                        begin timestamp (4), number of the previous entry in the slot (4)

so each slot chains its entries newest first.  Only the key's hash is stored: a lookup
yields candidate offsets that the caller confirms on the decoded record.  Entries are
appended in commit-log order, which lets recovery cut a file at an offset.  When a file
is full the next one is created; files are named by a sequence number.  The header and the
slot table are allocated on disk when a file is created, the entries a chunk at a time
ahead of them (a store into a hole of a full disk would raise SIGBUS; a failed allocation
is a :class:`~.disk.DiskFullError`).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import sys
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path

from .commitlog import fsync_dir
from .consumequeue import map_file
from .disk import ALLOC_CHUNK, allocate
from .types import NAME_WIDTH

__all__ = ["UNIQ_SEED", "IndexFile", "IndexService", "key_hash", "uniq_key_hash"]

log = logging.getLogger("txmq.broker.store")

HEADER = struct.Struct("<IIIIqqqqI4x")
ENTRY = struct.Struct("<IqiI")
SLOT = struct.Struct("<I")
MAGIC = 0x54584958  # "TXIX"
VERSION = 1
UNIQ_SEED = 0x5EED5EED


def key_hash(key: str) -> int:
    """Hash of a KEYS entry (stable across processes)."""
    return zlib.crc32(key.encode())


def uniq_key_hash(key: str) -> int:
    """Hash of a UNIQ_KEY (message id), kept apart from the KEYS hashes."""
    return zlib.crc32(key.encode(), UNIQ_SEED)


class IndexFile:
    __slots__ = (
        "allocated",
        "begin_phy",
        "begin_ts",
        "capacity",
        "count",
        "end_phy",
        "end_ts",
        "entries_at",
        "flushed_count",
        "mm",
        "path",
        "slots",
    )

    def __init__(self, path: Path, mm: mmap.mmap, slots: int, capacity: int) -> None:
        self.path = path
        self.mm = mm
        self.slots = slots
        self.capacity = capacity
        self.entries_at = HEADER.size + slots * SLOT.size
        self.begin_ts = 0
        self.end_ts = 0
        self.begin_phy = 0
        self.end_phy = 0
        self.count = 0
        self.flushed_count = -1
        #: bytes from the file's start whose disk blocks are reserved
        self.allocated = 0

    @classmethod
    def create(cls, path: Path, slots: int, capacity: int, phy: int, ts: int) -> IndexFile:
        size = HEADER.size + slots * SLOT.size + capacity * ENTRY.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            mm = map_file(fd, size)
        finally:
            os.close(fd)
        f = cls(path, mm, slots, capacity)
        try:
            f.reserve(1)
        except BaseException:
            mm.close()
            path.unlink(missing_ok=True)
            raise
        f.begin_ts = f.end_ts = ts
        f.begin_phy = f.end_phy = phy
        f.write_header()
        return f

    @classmethod
    def open(cls, path: Path) -> IndexFile | None:
        """Open an existing file; None if its header is unreadable (a torn creation)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER.size:
                return None
            head = os.pread(fd, HEADER.size, 0)
            magic, version, slots, cap, bts, ets, bphy, ephy, count = HEADER.unpack(head)
            if magic != MAGIC or version != VERSION or slots < 1 or count > cap:
                return None
            if size != HEADER.size + slots * SLOT.size + cap * ENTRY.size:
                return None
            mm = map_file(fd, size)
        finally:
            os.close(fd)
        f = cls(path, mm, slots, cap)
        f.begin_ts, f.end_ts, f.begin_phy, f.end_phy, f.count = bts, ets, bphy, ephy, count
        f.flushed_count = count
        return f

    def write_header(self) -> None:
        HEADER.pack_into(
            self.mm,
            0,
            MAGIC,
            VERSION,
            self.slots,
            self.capacity,
            self.begin_ts,
            self.end_ts,
            self.begin_phy,
            self.end_phy,
            self.count,
        )

    def reserve(self, n: int) -> None:
        """Allocate the disk blocks of the header, the slots and ``n`` more entries."""
        upto = self.entries_at + min(self.count + n, self.capacity) * ENTRY.size
        if upto <= self.allocated:
            return
        hi = min(len(self.mm), -(-upto // ALLOC_CHUNK) * ALLOC_CHUNK)
        allocate(self.path, self.allocated, hi - self.allocated)
        self.allocated = hi

    def add(self, h: int, phy: int, ts: int) -> None:
        if self.entries_at + (self.count + 1) * ENTRY.size > self.allocated:
            self.reserve(1)
        mm = self.mm
        slot_at = HEADER.size + (h % self.slots) * 4
        prev = SLOT.unpack_from(mm, slot_at)[0]
        n = self.count + 1
        ENTRY.pack_into(
            mm, self.entries_at + (n - 1) * 20, h, phy, (ts - self.begin_ts) // 1000, prev
        )
        self.count = n
        SLOT.pack_into(mm, slot_at, n)
        self.end_ts = ts
        self.end_phy = phy

    def lookup(self, h: int, begin_ts: int, end_ts: int) -> Iterator[int]:
        """Offsets of the entries with hash ``h`` stored in [begin_ts, end_ts], newest first."""
        mm = self.mm
        v = SLOT.unpack_from(mm, HEADER.size + (h % self.slots) * 4)[0]
        base_ts = self.begin_ts
        cap = self.capacity
        while 0 < v <= cap:
            eh, phy, delta, prev = ENTRY.unpack_from(mm, self.entries_at + (v - 1) * 20)
            if eh == h:
                approx = base_ts + delta * 1000  # the store time, rounded down to a second
                if approx <= end_ts and approx + 1000 > begin_ts:
                    yield phy
            if prev >= v:
                break
            v = prev

    def hashes_since(self, begin_ts: int) -> array[int]:
        """The hashes of the entries stored at or after ``begin_ts`` (ms; to the second:
        up to a second earlier too), in the order they were added."""
        lo, hi = 0, self.count  # the first entry (0-based) with its second >= begin's
        since = (begin_ts - self.begin_ts) // 1000
        while lo < hi:
            mid = (lo + hi) // 2
            if ENTRY.unpack_from(self.mm, self.entries_at + mid * 20)[2] < since:
                lo = mid + 1
            else:
                hi = mid
        words = array("I", self.mm[self.entries_at + lo * 20 : self.entries_at + self.count * 20])
        if sys.byteorder != "little":
            words.byteswap()
        return words[::5]  # each entry: hash, then 16 bytes more

    def _entry(self, n: int) -> tuple[int, int, int, int]:
        h, phy, delta, prev = ENTRY.unpack_from(self.mm, self.entries_at + (n - 1) * 20)
        return h, phy, delta, prev

    def cut(self, phy: int, trust_slots: bool) -> None:
        """Drop the entries pointing at or above ``phy`` and repair the slot table."""
        lo, hi = 0, self.count  # find the number of entries below phy
        while lo < hi:
            mid = (lo + hi) // 2
            if self._entry(mid + 1)[1] < phy:
                lo = mid + 1
            else:
                hi = mid
        keep = lo
        while keep > 0 and self._entry(keep) == (0, 0, 0, 0):
            keep -= 1  # never-written space counted by a header that reached the disk first
        if keep == self.count and trust_slots:
            return
        self._repair_slots(keep)
        self.count = keep
        if keep:
            self.end_phy = self._entry(keep)[1]
        self.write_header()
        self.mm.flush()

    def _repair_slots(self, keep: int) -> None:
        lo = HEADER.size
        table = array("I")
        table.frombytes(self.mm[lo : self.entries_at])
        if sys.byteorder != "little":
            table.byteswap()
        fixed: list[tuple[int, int]] = []
        for i in [i for i, v in enumerate(table) if v > keep]:
            v = table[i]
            while v > keep:
                if v > self.capacity:
                    self._rebuild_slots(keep)
                    return
                h, _phy, _d, prev = self._entry(v)
                if prev >= v or h % self.slots != i:
                    self._rebuild_slots(keep)
                    return
                v = prev
            fixed.append((i, v))
        for i, v in fixed:
            SLOT.pack_into(self.mm, lo + i * 4, v)

    def _rebuild_slots(self, keep: int) -> None:
        log.warning("index %s: slot table inconsistent, rebuilding it", self.path)
        table = array("I", bytes(self.slots * 4))
        for n in range(1, keep + 1):
            table[self._entry(n)[0] % self.slots] = n
        if sys.byteorder != "little":
            table.byteswap()
        self.mm[HEADER.size : self.entries_at] = table.tobytes()

    def flush(self) -> None:
        if self.flushed_count == self.count:
            return
        count = self.count
        self.write_header()
        self.mm.flush()
        self.flushed_count = count


class IndexService:
    def __init__(self, directory: Path, slots: int, capacity: int) -> None:
        self.dir = directory
        self.slots = slots
        self.capacity = capacity
        self.files: list[IndexFile] = []
        self._cur: IndexFile | None = None
        self._seq = 0
        self._dir_dirty = False

    def load(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        names = sorted(
            p for p in self.dir.iterdir() if len(p.name) == NAME_WIDTH and p.name.isdigit()
        )
        for path in names:
            self._seq = max(self._seq, int(path.name) + 1)
            f = IndexFile.open(path)
            if f is None:
                log.warning("index: dropping unreadable file %s", path)
                path.unlink()
                continue
            self.files.append(f)
        self._cur = self.files[-1] if self.files else None

    def put(self, h: int, phy: int, ts: int) -> None:
        f = self._cur
        if f is None or f.count >= f.capacity:
            f = self._roll(phy, ts)
        f.add(h, phy, ts)

    def reserve(self, n: int) -> None:
        """Allocate the disk blocks of the current file's next ``n`` entries (those that
        fit in it: a new file allocates its own when it is created)."""
        f = self._cur
        if f is None or f.entries_at + (f.count + n) * 20 <= f.allocated:
            return
        if f.count < f.capacity:
            f.reserve(n)

    def _roll(self, phy: int, ts: int) -> IndexFile:
        path = self.dir / f"{self._seq:0{NAME_WIDTH}d}"
        f = IndexFile.create(path, self.slots, self.capacity, phy, ts)
        self._seq += 1
        self.files = [*self.files, f]
        self._cur = f
        self._dir_dirty = True
        return f

    def lookup(self, h: int, begin_ts: int, end_ts: int) -> Iterator[int]:
        """Candidate commit-log offsets for hash ``h``, newest first (confirm each one)."""
        for f in reversed(self.files):
            if f.count and f.end_ts >= begin_ts - 1000 and f.begin_ts <= end_ts:
                yield from f.lookup(h, begin_ts, end_ts)

    def hashes_since(self, begin_ts: int) -> list[int]:
        """The key hashes (UNIQ_KEY and KEYS alike) of the entries stored at or after
        ``begin_ts`` (ms; up to a second earlier too), oldest first."""
        out: list[int] = []
        for f in self.files:
            if f.count and f.end_ts >= begin_ts - 1000:
                out.extend(f.hashes_since(begin_ts))
        return out

    def truncate(self, phy: int, trust_slots: bool) -> None:
        """Drop every entry pointing at or above ``phy`` (recovery)."""
        while self.files and self.files[-1].begin_phy >= phy:
            f = self.files.pop()
            f.mm.close()
            f.path.unlink()
            self._dir_dirty = True
        if self.files:
            self.files[-1].cut(phy, trust_slots)
        self._cur = self.files[-1] if self.files else None

    def expired_files(self, cl_min: int) -> list[IndexFile]:
        """Files (never the newest) whose every entry points below ``cl_min``."""
        out: list[IndexFile] = []
        for f in self.files[:-1]:
            if f.end_phy >= cl_min:
                break
            out.append(f)
        return out

    def forget(self, victims: list[IndexFile]) -> None:
        gone = {id(f) for f in victims}
        self.files = [f for f in self.files if id(f) not in gone]
        for f in victims:
            f.path.unlink(missing_ok=True)
        self._dir_dirty = True

    def flush(self) -> None:
        if self._dir_dirty:
            self._dir_dirty = False
            fsync_dir(self.dir)
        for f in self.files:
            f.flush()

    def close(self) -> None:
        for f in self.files:
            f.mm.close()
        self.files = []
        self._cur = None
