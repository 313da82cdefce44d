"""ASGI applications (FastAPI, Starlette): txmq's clients started and stopped with the
application, and a local transaction per request.

::

    from txmq.asgi import transaction_dependency, txmq_lifespan

    producer = TransactionProducer(group="orders", listener=SqlTransactionChecker(engine))
    consumer = PushConsumer(group="billing", listener=bill)
    app = FastAPI(lifespan=txmq_lifespan(producer, consumer))
    Tx = Annotated[AsyncLocalTransaction, transaction_dependency(producer, sessions)]

    @app.post("/orders")
    async def place(tx: Tx) -> dict[str, str]:
        tx.session.add(Order(...))
        await tx.send(Message("orders", body))   # committed with the row, when this returns

Neither FastAPI nor Starlette is imported here: a lifespan is a function of the application
that returns an async context manager, which both frameworks take as ``lifespan=``; FastAPI
is imported only by :func:`transaction_dependency`, when it is called.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, Protocol, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from txmq.sqla.local import AsyncLocalTransaction, AsyncTransactionalProducer, transaction

__all__ = [
    "ClientStartFailed",
    "Lifespan",
    "Startable",
    "running",
    "transaction_dependency",
    "txmq_lifespan",
]

App = TypeVar("App")

#: what Starlette and FastAPI take as ``lifespan=``: the application -> an async context
#: manager, whose value (None, or a mapping) becomes the requests' ``request.state``
Lifespan = Callable[[App], AbstractAsyncContextManager[Mapping[str, Any] | None]]


class Startable(Protocol):
    """A client the lifespan runs: txmq's async ``Producer``, ``TransactionProducer``,
    ``PushConsumer``, ``PullConsumer``, ``OutboxRelay``, or anything else with async
    ``start()`` and ``stop()``."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class ClientStartFailed(RuntimeError):
    """A client of :func:`running` (:func:`txmq_lifespan`) did not start; those started
    before it were stopped.  Its message is one line naming the client and the cause (the
    cause's exception is ``__cause__``)."""


def _describe(client: object) -> str:
    group = getattr(client, "group", None)
    name = type(client).__name__
    return f"{name} {group!r}" if isinstance(group, str) else name


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check(clients: tuple[Startable, ...]) -> None:
    for client in clients:
        start = getattr(client, "start", None)
        if not (inspect.iscoroutinefunction(start) and hasattr(client, "stop")):
            raise TypeError(
                f"{type(client).__module__}.{type(client).__name__} is not an async client: "
                "an ASGI lifespan takes txmq's async clients (txmq.Producer, "
                "txmq.TransactionProducer, txmq.PushConsumer, txmq.outbox.OutboxRelay), "
                "not txmq.sync's"
            )


@asynccontextmanager
async def running(*clients: Startable) -> AsyncIterator[None]:
    """Start ``clients`` in order, and stop them in reverse order when the block ends.

    If one fails to start, those started before it are stopped (in reverse order) and
    :class:`ClientStartFailed` is raised, with a one-line message.  Cancellation and
    ``KeyboardInterrupt`` during start stop the started ones too and propagate as they are.
    """
    _check(clients)
    async with AsyncExitStack() as stack:
        for number, client in enumerate(clients, 1):
            try:
                await client.start()
            except Exception as exc:
                started = number - 1
                raise ClientStartFailed(
                    f"txmq: {_describe(client)} (client {number} of {len(clients)}) did not "
                    f"start: {_one_line(exc)}"
                    + (f"; stopped the {started} started before it" if started else "")
                ) from exc
            stack.push_async_callback(client.stop)
        yield


def txmq_lifespan(*clients: Startable, lifespan: Lifespan[App] | None = None) -> Lifespan[App]:
    """A lifespan for Starlette's or FastAPI's ``lifespan=``: ``clients`` start (in order)
    before the application serves, and stop (in reverse) after it stopped serving —
    :func:`running` around the application's life.

    ``lifespan``: the application's own lifespan, run inside (after the clients started,
    ended before they stop), so its startup may already send; the state it yields is the
    application's.  Or compose the other way round, in your own lifespan:
    ``async with running(producer, consumer): ...``.
    """
    _check(clients)

    @asynccontextmanager
    async def run(app: App) -> AsyncIterator[Mapping[str, Any] | None]:
        async with running(*clients):
            if lifespan is None:
                yield None
            else:
                async with lifespan(app) as state:
                    yield state

    return run


def transaction_dependency(
    producer: AsyncTransactionalProducer,
    sessions: async_sessionmaker[AsyncSession],
    *,
    group: str | None = None,
) -> Any:
    """FastAPI: a dependency (``Depends(...)``) that gives each request an
    :class:`~txmq.sqla.AsyncLocalTransaction` on a new session of ``sessions``
    (``tx.session``).  When the endpoint returns, the session commits and the messages
    sent with ``tx.send`` are committed at the broker; when it raises (an
    ``HTTPException`` too), both are rolled back — before the response is sent (FastAPI's
    ``scope="function"``), so a commit that fails is the request's error, never after a
    200.  Use it in a parameter's annotation:
    ``tx: Annotated[AsyncLocalTransaction, transaction_dependency(producer, sessions)]``.

    Needs FastAPI 0.121.1 or later (``scope="function"``).  Plain Starlette has no
    dependencies: ``async with txmq.sqla.transaction(producer, sessions) as tx:`` in the
    endpoint does the same.
    """
    try:
        from fastapi import Depends
    except ImportError:
        raise ImportError(
            "txmq.asgi.transaction_dependency needs FastAPI (pip install fastapi); with "
            "plain Starlette use 'async with txmq.sqla.transaction(producer, sessions)'"
        ) from None
    if not isinstance(sessions, async_sessionmaker):
        raise TypeError(
            "transaction_dependency takes an async_sessionmaker (a new session per request), "
            f"not {type(sessions).__name__}"
        )

    async def local_transaction() -> AsyncIterator[AsyncLocalTransaction]:
        async with transaction(producer, sessions, group=group) as tx:
            yield tx

    return Depends(local_transaction, scope="function")
