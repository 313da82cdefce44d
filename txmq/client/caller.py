"""Running plain functions in the thread that waits for the event loop.

A synchronous facade call (:mod:`txmq.sync`) blocks its thread until the async code it
runs on the client's event loop is done.  Meanwhile that code may hand plain functions back
to the waiting thread with :func:`in_caller_thread` — the transactional producer runs a
blocking ``execute_local_transaction`` so, where the caller's thread-bound session lives.
Outside of a facade call (plain async use) such a function runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

import anyio.to_thread

__all__ = ["CallerThread", "in_caller_thread", "serving"]

P = ParamSpec("P")
R = TypeVar("R")


class CallerThread:
    """Jobs the event loop hands to the thread blocked in a facade call, while it waits."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._serving = True

    async def run(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` in the caller's thread (in a worker thread once the call is over)."""
        job: Future[R] = Future()
        with self._lock:
            if self._serving:
                self._jobs.put((fn, job))
            else:
                job = None  # type: ignore[assignment]
        if job is None:
            return await anyio.to_thread.run_sync(fn)
        return await asyncio.wrap_future(job)

    def serve(self, call: Future[R]) -> R:
        """Run the jobs handed over until ``call`` is done; its result."""
        call.add_done_callback(lambda _: self._jobs.put(None))
        while (item := self._jobs.get()) is not None:
            fn, job = item
            if job.set_running_or_notify_cancel():
                try:
                    job.set_result(fn())
                except BaseException as exc:
                    job.set_exception(exc)
        with self._lock:
            self._serving = False
        while not self._jobs.empty():  # handed over as the call ended: a worker runs them
            item = self._jobs.get()
            if item is not None:
                fn, job = item
                threading.Thread(target=_settle, args=(fn, job), daemon=True).start()
        return call.result()


def _settle(fn: Callable[[], Any], job: Future[Any]) -> None:
    try:
        job.set_result(fn())
    except BaseException as exc:
        job.set_exception(exc)


_CALLER: ContextVar[CallerThread | None] = ContextVar("txmq_sync_caller", default=None)


async def in_caller_thread(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run the plain function ``fn`` in the thread of the facade call this code serves;
    outside of one (plain async use), in a worker thread."""
    call = functools.partial(fn, *args, **kwargs)
    caller = _CALLER.get()
    if caller is None:
        return await anyio.to_thread.run_sync(call)
    return await caller.run(call)


async def serving(caller: CallerThread, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (awaited if it returns an awaitable), with ``caller`` as the
    thread :func:`in_caller_thread` hands work to."""
    token = _CALLER.set(caller)
    try:
        result = fn(*args, **kwargs)
        if isinstance(result, Awaitable):
            result = await result
        return result
    finally:
        _CALLER.reset(token)
