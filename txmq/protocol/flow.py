"""Flow control for a server's connections: what one peer may hold of it (unread answers,
unanswered requests, unfinished frames, idle time) and the memory all peers share for
frames still arriving.  :class:`txmq.protocol.connection.Connection` applies them."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import anyio.abc

__all__ = ["FRAME_ALLOWANCE", "ConnectionLimits", "FrameBudget", "stop_eager_reading"]


@dataclass(frozen=True)
class ConnectionLimits:
    """What one peer may hold of a server: a connection past a limit stops being read
    (answers it does not read, requests not yet answered) or is closed (idle, a frame
    that never completes, answers it has not taken for ``idle_timeout``)."""

    #: close a connection that neither sent nor received anything for this long
    #: (RocketMQ: channels idle for 120 s are closed); None: never
    idle_timeout: float | None = 120.0
    #: close a connection whose started frame is not complete after this long; None: never
    frame_timeout: float | None = 30.0
    #: stop reading a peer while this many bytes of answers wait to be written to it
    write_buffer: int = 4 * 1024 * 1024
    #: stop reading a peer while this many of its requests are not answered yet
    max_inflight: int = 10_000
    #: memory all peers together may hold in frames they have not finished sending: a
    #: frame past :data:`FRAME_ALLOWANCE` bytes waits (unread) until its whole size fits
    frame_memory: int = 64 * 1024 * 1024

    @property
    def check_interval(self) -> float:
        timeouts = [t for t in (self.idle_timeout, self.frame_timeout) if t]
        return min([1.0, *(t / 4 for t in timeouts)])


#: what a connection may hold of an unfinished frame before it must reserve the frame's
#: size from the shared :class:`FrameBudget`
FRAME_ALLOWANCE = 64 * 1024


class FrameBudget:
    """Memory for frames being received, shared by a server's connections.  A reservation
    is a whole frame, first come first served, so no two peers can each hold half of it."""

    def __init__(self, total: int) -> None:
        self.total = self.free = total
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, size: int) -> None:
        size = min(size, self.total)
        if not self._waiters and self.free >= size:
            self.free -= size
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (size, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(size)  # granted as it was cancelled: give it back
            else:
                self._waiters.remove(entry)
            raise

    def release(self, size: int) -> None:
        self.free += min(size, self.total)
        while self._waiters and self._waiters[0][0] <= self.free:
            size, fut = self._waiters.popleft()
            self.free -= size
            fut.set_result(None)


def stop_eager_reading(stream: anyio.abc.ByteStream) -> None:
    """anyio's asyncio socket stream reads only while :meth:`receive` waits, except when
    data came before its first ``receive``: then it reads everything the peer sends into
    memory, however much that is (anyio 4).  Pause it; ``receive`` resumes it as needed."""
    transport = getattr(stream, "_transport", None)
    pause = getattr(transport, "pause_reading", None)
    if pause is not None and transport.is_reading():  # type: ignore[union-attr]
        pause()
