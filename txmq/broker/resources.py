"""What the broker process asks of the system when it starts: room for many connections,
and memory that goes back to the system when big frames are done with."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource

__all__ = ["pin_mmap_threshold", "prepare_process", "raise_fd_limit"]

log = logging.getLogger("txmq.broker")

#: glibc's mallopt parameter (malloc.h)
_M_MMAP_THRESHOLD = -3
#: allocations from this size up get their own mapping, returned to the system when freed
MMAP_THRESHOLD = 1024 * 1024


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit (each connection takes one);
    the limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # pragma: no cover - depends on the system
            log.info("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


def pin_mmap_threshold(size: int = MMAP_THRESHOLD) -> bool:
    """Have glibc map every allocation of ``size`` bytes or more on its own.

    Left alone, glibc raises its threshold to the largest block freed so far: after one
    15 MiB frame, the next ones come from the heap, which fragments and keeps what it
    grew.  The broker's big blocks (frames, pull answers) are short-lived, so they are
    better mapped and unmapped.  False where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, size))


def prepare_process() -> None:
    """Everything above, logged in one line."""
    files = raise_fd_limit()
    pinned = pin_mmap_threshold()
    log.info(
        "open-file limit %d (a connection takes one); allocations of %d KiB and more %s",
        files,
        MMAP_THRESHOLD // 1024,
        "mapped on their own" if pinned else "left to the C library",
    )
