"""Requests that come together go together: the proxy's sends (and acks) to one broker set
leave as one request (SEND_MESSAGES, an ACK_MESSAGE of several handles), each item answered
on its own.

A batch leaves at the end of the event loop's turn in which its first item came when
nothing is out for its key (a lone send waits for nothing), else up to ``linger_s`` later —
or at once when it is full.  Under load the sends of many clients then share a frame, a
read and a reply on the broker, whose CPU per message is what a proxy is for: a broker
spends about as much on a request as on storing a message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

__all__ = ["Batches"]

K = TypeVar("K", bound=Hashable)
I = TypeVar("I")  # noqa: E741 - an item
R = TypeVar("R")


class _Open(Generic[I, R]):
    """A batch still taking items."""

    __slots__ = ("futures", "items", "size")

    def __init__(self) -> None:
        self.items: list[I] = []
        self.futures: list[asyncio.Future[R]] = []
        self.size = 0


class Batches(Generic[K, I, R]):
    """Items by key, sent as ``send(key, items)``, which answers each item's result or
    exception in order (or raises: every item of the batch fails so)."""

    def __init__(
        self,
        send: Callable[[K, list[I]], Awaitable[Sequence[R | BaseException]]],
        *,
        linger_s: float = 0.0,
        max_items: int = 128,
        max_bytes: int = 4 * 1024 * 1024,
        size: Callable[[I], int] = lambda item: 0,
    ) -> None:
        self._send = send
        self.linger_s = linger_s
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._size = size
        self._open: dict[K, _Open[I, R]] = {}
        self._out: dict[K, int] = {}
        self._running: set[asyncio.Task[None]] = set()
        #: batches sent and the items in them (items per batch: what the brokers are spared)
        self.batches = 0
        self.items = 0

    def submit(self, key: K, item: I) -> asyncio.Future[R]:
        """The future of ``item``'s result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        size = self._size(item)
        batch = self._open.get(key)
        if batch is not None and (
            len(batch.items) >= self.max_items or batch.size + size > self.max_bytes
        ):
            self._flush(key)  # full: it goes now, this one starts the next
            batch = None
        if batch is None:
            batch = self._open[key] = _Open()
            if self.linger_s > 0 and self._out.get(key):
                loop.call_later(self.linger_s, self._flush, key, batch)
            else:
                loop.call_soon(self._flush, key, batch)
        batch.items.append(item)
        batch.futures.append(fut)
        batch.size += size
        return fut

    def _flush(self, key: K, only: _Open[I, R] | None = None) -> None:
        batch = self._open.get(key)
        if batch is None or (only is not None and batch is not only):
            return  # sent already (it filled up)
        del self._open[key]
        self.batches += 1
        self.items += len(batch.items)
        self._out[key] = self._out.get(key, 0) + 1
        task = asyncio.get_running_loop().create_task(self._run(key, batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, key: K, batch: _Open[I, R]) -> None:
        try:
            results = await self._send(key, batch.items)
        except asyncio.CancelledError:  # the proxy stops
            for fut in batch.futures:
                fut.cancel()
            raise
        except Exception as exc:
            for fut in batch.futures:
                if not fut.done():
                    fut.set_exception(exc)
            return
        finally:
            out = self._out[key] - 1
            if out:
                self._out[key] = out
            else:
                del self._out[key]
        for fut, result in zip(batch.futures, results, strict=True):
            if fut.done():
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)
