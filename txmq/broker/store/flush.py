"""Background threads: the commit-log flusher (group commit) and periodic services."""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections.abc import Callable

from .commitlog import CommitLog
from .types import FlushMode, StoreError

__all__ = ["CommitLogFlusher", "PeriodicThread"]

log = logging.getLogger("txmq.broker.store")

_Waiter = tuple[int, int, asyncio.AbstractEventLoop, "asyncio.Future[None]"]


def _resolve(futs: list[asyncio.Future[None]]) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_result(None)


def _reject(futs: list[asyncio.Future[None]]) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_exception(StoreError("the store was shut down before the flush"))


class CommitLogFlusher:
    """fsyncs the commit log: periodically (ASYNC) or on request, for groups (SYNC).

    In SYNC mode the thread sleeps until a waiter asks for a flush, then fsyncs everything
    written so far with one call and releases every waiter whose end offset is covered;
    requests that arrive during an fsync are served together by the next one.
    """

    def __init__(self, commit_log: CommitLog, mode: FlushMode, interval_ms: int) -> None:
        self._cl = commit_log
        self._sync = mode is FlushMode.SYNC
        self._interval = interval_ms / 1000
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the flush thread waits here
        self._done = threading.Condition(self._lock)  # blocking waiters wait here
        self._fsync_lock = threading.Lock()
        self._waiters: list[_Waiter] = []
        self._seq = 0
        self._requested = False
        self._stopping = False
        self._stopped = True  # until started
        self._thread: threading.Thread | None = None
        #: every byte below this offset is fsynced
        self.flushed = 0

    def start(self, flushed: int) -> None:
        self.flushed = flushed
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="txmq-store-flush", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush_now()
        with self._lock:
            self._stopped = True
            rest, self._waiters = self._waiters, []
            self._done.notify_all()
        _call_soon(rest, _reject)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._sync:
                    if not self._requested and not self._stopping:
                        self._wake.wait(self._interval)
                else:
                    deadline = time.monotonic() + self._interval
                    while not self._stopping:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._wake.wait(left)
                if self._stopping:
                    return
                self._requested = False
            try:
                self.flush_now()
            except Exception:
                log.exception("commit log flush failed")
                time.sleep(self._interval)

    def flush_now(self) -> int:
        """fsync everything written so far; return the flushed offset."""
        with self._fsync_lock:
            target = self._cl.write_pos
            if target > self.flushed or self._cl.dir_dirty:
                self._cl.fsync_range(self.flushed, target)
        ready: list[_Waiter] = []
        with self._lock:
            if target > self.flushed:
                self.flushed = target
            while self._waiters and self._waiters[0][0] <= self.flushed:
                ready.append(heapq.heappop(self._waiters))
            self._done.notify_all()
        _call_soon(ready, _resolve)
        return self.flushed

    async def wait(self, end_offset: int) -> None:
        fut = self.future(end_offset)
        if fut is not None:
            await fut

    def future(self, end_offset: int) -> asyncio.Future[None] | None:
        """A future of the running loop settled once ``end_offset`` is flushed (None: it is)."""
        if self.flushed >= end_offset:
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.flushed >= end_offset:
                return None
            if self._stopped:
                raise StoreError("the store is not running")
            self._seq += 1
            heapq.heappush(self._waiters, (end_offset, self._seq, loop, fut))
            if self._sync and not self._requested:
                self._requested = True
                self._wake.notify()
        return fut

    def wait_blocking(self, end_offset: int, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.flushed < end_offset:
                if self._stopped:
                    return False
                if self._sync and not self._requested:
                    self._requested = True
                    self._wake.notify()
                if deadline is None:
                    self._done.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._done.wait(left)
            return True


def _call_soon(waiters: list[_Waiter], fn: Callable[[list[asyncio.Future[None]]], None]) -> None:
    """Settle the waiters' futures with one wake-up of each event loop (not one per future)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for _end, _seq, loop, fut in waiters:
        by_loop.setdefault(loop, []).append(fut)
    for loop, futs in by_loop.items():
        try:
            loop.call_soon_threadsafe(fn, futs)
        except RuntimeError:  # the waiter's loop is closed
            pass


class PeriodicThread:
    """Calls ``fn`` every ``interval`` seconds on a daemon thread until stopped.

    An exception is logged with its stack, unless ``quiet(exc)`` says it is accounted for
    (a full disk, which the store logs once when it fills).
    """

    def __init__(
        self,
        name: str,
        interval: float,
        fn: Callable[[], object],
        quiet: Callable[[BaseException], bool] | None = None,
    ) -> None:
        self._fn = fn
        self._quiet = quiet
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._fn()
            except Exception as exc:
                if self._quiet is None or not self._quiet(exc):
                    log.exception("%s failed", self._thread.name)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
