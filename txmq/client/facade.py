"""What every synchronous facade (:mod:`txmq.sync`) is made of: a :class:`SyncClient` runs
an async client for its whole lifetime in one task of an event loop in a background thread
(an anyio blocking portal), and :class:`blocking` derives each facade method from its async
twin — the same parameters and result, typed as the twin is; the facade adds no logic.
While a facade call waits, the calling thread runs what the async code hands back to it
(:func:`txmq.client.caller.in_caller_thread`: the transactional producer's local
transaction, so that thread-bound sessions work)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal, start_blocking_portal

from txmq.client.caller import CallerThread, serving

__all__ = ["AsyncLifecycle", "SyncClient", "blocking"]

P = ParamSpec("P")
R = TypeVar("R")


class AsyncLifecycle(Protocol):
    """What a facade can run: an object used as ``async with obj: ...``."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: Any) -> Any: ...


C = TypeVar("C", bound=AsyncLifecycle)


class SyncClient(Generic[C]):
    """Runs ``client`` (an async client, or anything with ``async with``) for its whole
    lifetime in one task of an event loop in a background thread; ``_call`` runs its
    methods there."""

    def __init__(self, client: C) -> None:
        self.aio = client
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._stop_event: anyio.Event | None = None
        self._lifetime: Future[None] | None = None

    def start(self) -> Self:
        if self._portal is not None:
            return self
        cm = start_blocking_portal()
        portal = cm.__enter__()
        try:
            self._lifetime, _ = portal.start_task(self._run)
        except BaseException:
            cm.__exit__(None, None, None)
            raise
        self._portal_cm, self._portal = cm, portal
        return self

    async def _run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self._stop_event = anyio.Event()
        async with self.aio:
            task_status.started()
            await self._stop_event.wait()

    def stop(self) -> None:
        portal, cm = self._portal, self._portal_cm
        if portal is None or cm is None:
            return
        self._portal = self._portal_cm = None
        try:
            if self._stop_event is not None:
                portal.call(self._stop_event.set)
            if self._lifetime is not None:
                self._lifetime.result()
        finally:
            cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the client's event loop (awaited if it is a coroutine),
        while this thread runs what it hands back with :func:`in_caller_thread`."""
        portal = self._portal
        if portal is None:
            raise RuntimeError("client is not started: call start() or use 'with'")
        caller = CallerThread()
        call = functools.partial(serving, caller, fn, *args, **kwargs)
        return caller.serve(portal.start_task_soon(call))


class blocking(Generic[P, R]):
    """A facade method derived from the async client's method of the same name: the same
    parameters and result, run on the client's event loop (see :meth:`SyncClient._call`)::

        class Producer(SyncClient[txmq.Producer]):
            send = blocking(txmq.Producer.send)
    """

    @overload
    def __init__(self, twin: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]) -> None: ...

    @overload
    def __init__(self, twin: Callable[Concatenate[Any, P], R]) -> None: ...

    def __init__(self, twin: Callable[..., Any]) -> None:
        self.twin = twin
        self.name = twin.__name__
        self.__doc__ = twin.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.name:
            raise TypeError(f"{owner.__name__}.{name} is derived from {self.name}: same name")

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...

    @overload
    def __get__(self, obj: SyncClient[Any], owner: type) -> Callable[P, R]: ...

    def __get__(self, obj: SyncClient[Any] | None, owner: type) -> Self | Callable[P, R]:
        if obj is None:
            return self
        name = self.name

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            # looked up on the client itself, so that a subclass's override runs
            result: R = obj._call(getattr(obj.aio, name), *args, **kwargs)
            return result

        call.__name__ = name
        call.__doc__ = self.__doc__
        return call
