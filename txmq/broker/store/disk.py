"""A full disk: the store refuses writes before the disk fills, and a write that fails for
want of space is refused cleanly instead of crashing the broker.

RocketMQ marks its store not writable when the disk holding it is used over
``diskSpaceWarningLevelRatio`` (0.90) and writable again when usage falls below it; a put
meanwhile answers "service not available" and the producer tries another broker.
:class:`DiskGuard` does the same: :meth:`DiskGuard.check` (the broker calls it every
``disk_check_interval_s``) compares the usage with ``disk_max_used_ratio``, and
:meth:`DiskGuard.failed` turns the store not writable the moment a write fails with
ENOSPC or EDQUOT, until space has been freed.  Each change of state is logged as one line.

Memory-mapped files (consume queues, the key index) are sparse; storing into a page of a
hole on a full disk raises SIGBUS, which kills the process.  Their writers reserve the
space first with :func:`allocate` (``posix_fallocate``), whose ENOSPC is an ordinary
:class:`DiskFullError`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .types import PutResult, PutStatus, StoreError

__all__ = [
    "ALLOC_CHUNK",
    "DiskFullError",
    "DiskGuard",
    "DiskUsage",
    "allocate",
    "check_writable",
    "disk_usage",
    "is_disk_full",
]

log = logging.getLogger("txmq.broker.store")

#: errno values that mean "no room on the disk" (a quota is a full disk for this process)
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
#: how much of a memory-mapped file is allocated at a time, ahead of the writes
ALLOC_CHUNK = 64 * 1024
#: after a write failed for want of space, writes are taken again once this much more
#: than was free then is free (at least; 1 % of the disk on big disks)
RESUME_MARGIN = 1024 * 1024


class DiskFullError(StoreError):
    """A write failed, or would fail, because the disk holding the store is full."""


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is an ENOSPC / EDQUOT failure."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, DiskFullError):
            return True
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def allocate(path: Path, offset: int, length: int) -> None:
    """Reserve disk blocks for ``[offset, offset + length)`` of the file at ``path``
    (existing data is kept); :class:`DiskFullError` if the disk has no room.  A file
    system that cannot preallocate is left alone."""
    if length <= 0:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in NO_SPACE:
            raise DiskFullError(f"no room to allocate {length} bytes of {path}: {exc}") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    finally:
        os.close(fd)


def check_writable(root: Path) -> None:
    """Create ``root`` if missing and make sure files can be created in it; else a
    :class:`StoreError` that says why in one sentence (a read-only file system, no
    permission)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        except OSError as exc:  # the probe's name would say nothing: name the store
            raise OSError(exc.errno, exc.strerror, str(root)) from exc
        probe.unlink()
    except OSError as exc:
        raise StoreError(unwritable(root, exc) or f"cannot write to store {root}: {exc}") from exc


def unwritable(root: Path, exc: BaseException) -> str | None:
    """One sentence for an error writing a file of the store (or creating its folder)
    that means the store cannot be written at all; None for any other error."""
    if not isinstance(exc, OSError) or not isinstance(exc.filename, (str, bytes, os.PathLike)):
        return None
    name = os.path.abspath(os.fsdecode(exc.filename))
    base = os.path.abspath(root)
    if os.path.commonpath([name, base]) not in (name, base):
        return None  # not a file of the store (a port, another file)
    where = f" ({name})" if name != base else ""
    if exc.errno == errno.EROFS:
        return (
            f"store {root} is on a read-only file system{where}: the broker writes there; "
            "remount it read-write, or give another --store"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"no permission to write to store {root}{where}: run the broker as a user who "
            "may, or give another --store"
        )
    if exc.errno in NO_SPACE:
        return (
            f"the disk holding store {root} is full{where}: free some space, or give "
            "another --store"
        )
    return None


@dataclass(frozen=True)
class DiskUsage:
    total: int
    #: bytes this process may still write (statvfs's f_bavail)
    free: int

    @property
    def ratio(self) -> float:
        """The used share as ``df`` counts it: used / (used + available)."""
        return 1.0 - self.free / self.total if self.total > 0 else 0.0


def disk_usage(path: Path) -> DiskUsage:
    st = os.statvfs(path)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    free = st.f_bavail * st.f_frsize
    return DiskUsage(used + free, free)


class DiskGuard:
    """Whether the store may write, by the usage of the disk that holds it.

    :attr:`full` is read without a lock on the put path; :meth:`check` and
    :meth:`failed` change it (from any thread) and log each change once.
    """

    def __init__(self, root: Path, max_used_ratio: float) -> None:
        self.root = root
        self.max_used_ratio = max_used_ratio
        #: writes are refused
        self.full = False
        #: why, for the refused client (empty while writes are taken)
        self.reason = ""
        self.last = DiskUsage(0, 0)
        self._lock = threading.Lock()
        #: after a failed write: free bytes then (writes wait for more than that)
        self._free_at_failure: int | None = None

    def _usage(self) -> DiskUsage | None:
        try:
            u = disk_usage(self.root)
        except OSError:
            return None
        self.last = u
        return u

    def refusal(self) -> PutResult:
        """The put result of a refused write."""
        return PutResult(PutStatus.DISK_FULL, -1, -1, 0, 0, self.reason or self._say())

    def _say(self, u: DiskUsage | None = None) -> str:
        u = u or self.last
        return (
            f"the broker's disk is full: store {self.root} is {u.ratio:.1%} used "
            f"({_mib(u.free)} free), over disk_max_used_ratio {self.max_used_ratio:g}; "
            "try another broker, or later"
        )

    def check(self) -> bool:
        """Look at the disk's usage now, refuse or take writes accordingly; whether full."""
        u = self._usage()
        if u is None:
            return self.full
        with self._lock:
            over = u.ratio > self.max_used_ratio
            if self._free_at_failure is not None:
                margin = max(RESUME_MARGIN, u.total // 100)
                if not over and u.free < self._free_at_failure + margin:
                    return True  # still as full as when the write failed
            if over and not self.full:
                self.full = True
                self.reason = self._say(u)
                log.warning(
                    "disk full: store %s is %.1f%% used (%s free), over disk_max_used_ratio "
                    "%g; writes are refused until it is at most that",
                    self.root,
                    u.ratio * 100,
                    _mib(u.free),
                    self.max_used_ratio,
                )
            elif over:
                self.reason = self._say(u)
            elif self.full:
                self.full = False
                self.reason = ""
                self._free_at_failure = None
                log.warning(
                    "disk has room again: store %s is %.1f%% used (%s free, "
                    "disk_max_used_ratio %g); writes are taken again",
                    self.root,
                    u.ratio * 100,
                    _mib(u.free),
                    self.max_used_ratio,
                )
            return self.full

    def failed(self, exc: BaseException) -> PutResult:
        """A write failed with ENOSPC / EDQUOT: refuse writes until space is freed; the put
        result to answer with."""
        u = self._usage() or self.last
        with self._lock:
            self._free_at_failure = u.free
            self.reason = (
                f"the broker's disk is full: no room left for store {self.root} "
                f"({u.ratio:.1%} used, {_mib(u.free)} free); try another broker, or later"
            )
            if not self.full:
                self.full = True
                log.warning(
                    "disk full: a write to store %s failed (%s; %.1f%% used, %s free); "
                    "writes are refused until space is freed",
                    self.root,
                    _strerror(exc),
                    u.ratio * 100,
                    _mib(u.free),
                )
        return self.refusal()

    def absorb(self, exc: BaseException) -> bool:
        """For background writers: True (after :meth:`failed`) if ``exc`` is a full disk,
        which the state line already says; False for any other error."""
        if not is_disk_full(exc):
            return False
        self.failed(exc)
        return True


def _strerror(exc: BaseException | None) -> str:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return os.strerror(exc.errno or 0)
        exc = exc.__cause__ or exc.__context__
    return "no space left on device"


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"
