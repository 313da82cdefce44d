"""Synchronous facades over the async clients (one copy of the logic: the async one).

Each facade runs its async client on an event loop in a background thread (an anyio
blocking portal) and keeps the client's whole lifetime inside one task there::

    with txmq.sync.Producer("127.0.0.1:10911") as producer:
        result = producer.send(Message("orders", b"..."))

Every method is derived from its async twin by :class:`blocking`: the same parameters and
the same result, typed as the twin is; the facade adds no logic.  While a facade call
waits, the calling thread runs what the async code hands back to it
(:func:`txmq.caller.in_caller_thread`: the transactional producer's local transaction, so
that thread-bound sessions work).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal, start_blocking_portal

from txmq import admin as _admin
from txmq import producer as _producer
from txmq import pull as _pull
from txmq import push as _push
from txmq import transaction as _tx
from txmq.caller import CallerThread, serving
from txmq.message import MessageExt
from txmq.route import MessageQueue

__all__ = [
    "AdminClient",
    "Producer",
    "PullConsumer",
    "PushConsumer",
    "SyncClient",
    "TransactionProducer",
    "blocking",
    "wait_consumed",
]

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


class Producer(SyncClient[_producer.Producer]):
    """Blocking producer; same arguments as :class:`txmq.producer.Producer`."""

    def __init__(self, address: str | None = None, group: str = "DEFAULT_PRODUCER", **kw: Any):
        super().__init__(_producer.Producer(address, group, **kw))

    send = blocking(_producer.Producer.send)
    send_async = blocking(_producer.Producer.send_async)
    send_oneway = blocking(_producer.Producer.send_oneway)
    send_batch = blocking(_producer.Producer.send_batch)
    route = blocking(_producer.Producer.route)


class TransactionProducer(SyncClient[_tx.TransactionProducer]):
    """Blocking transactional producer; same arguments as
    :class:`txmq.transaction.TransactionProducer`.

    ``send_message_in_transaction`` runs a plain ``execute_local_transaction`` in the
    calling thread (so thread-bound sessions work); check-backs run in worker threads
    (plain functions) or on the client's event loop (coroutine functions).
    """

    def __init__(self, address: str | None = None, group: str = "DEFAULT_PRODUCER", **kw: Any):
        super().__init__(_tx.TransactionProducer(address, group, **kw))

    @property
    def group(self) -> str:
        return self.aio.group

    @property
    def listener(self) -> _tx.TransactionListener | None:
        return self.aio.listener

    @listener.setter
    def listener(self, listener: _tx.TransactionListener | None) -> None:
        self.aio.listener = listener

    send = blocking(_tx.TransactionProducer.send)
    send_half = blocking(_tx.TransactionProducer.send_half)
    end_transaction = blocking(_tx.TransactionProducer.end_transaction)
    send_message_in_transaction = blocking(_tx.TransactionProducer.send_message_in_transaction)


class PullConsumer(SyncClient[_pull.PullConsumer]):
    def __init__(self, address: str | None = None, group: str = "DEFAULT_CONSUMER", **kw: Any):
        super().__init__(_pull.PullConsumer(address, group, **kw))

    queues = blocking(_pull.PullConsumer.queues)
    message_queues = blocking(_pull.PullConsumer.message_queues)
    pull = blocking(_pull.PullConsumer.pull)
    commit_offset = blocking(_pull.PullConsumer.commit_offset)
    fetch_offset = blocking(_pull.PullConsumer.fetch_offset)
    max_offset = blocking(_pull.PullConsumer.max_offset)
    min_offset = blocking(_pull.PullConsumer.min_offset)


class AdminClient(SyncClient[_admin.AdminClient]):
    def __init__(self, address: str | None = None, **kw: Any):
        super().__init__(_admin.AdminClient(address, **kw))

    topics = blocking(_admin.AdminClient.topics)
    topic_stats = blocking(_admin.AdminClient.topic_stats)
    create_topic = blocking(_admin.AdminClient.create_topic)
    delete_topic = blocking(_admin.AdminClient.delete_topic)
    message_by_id = blocking(_admin.AdminClient.message_by_id)
    messages_by_key = blocking(_admin.AdminClient.messages_by_key)
    offsets = blocking(_admin.AdminClient.offsets)
    runtime_info = blocking(_admin.AdminClient.runtime_info)
    dlq_list = blocking(_admin.AdminClient.dlq_list)
    dlq_resend = blocking(_admin.AdminClient.dlq_resend)
    transactions = blocking(_admin.AdminClient.transactions)
    decisions = blocking(_admin.AdminClient.decisions)
    decide_transaction = blocking(_admin.AdminClient.decide_transaction)
    create_user = blocking(_admin.AdminClient.create_user)
    update_user = blocking(_admin.AdminClient.update_user)
    delete_user = blocking(_admin.AdminClient.delete_user)
    users = blocking(_admin.AdminClient.users)
    add_rule = blocking(_admin.AdminClient.add_rule)
    delete_rule = blocking(_admin.AdminClient.delete_rule)
    acl_targets = blocking(_admin.AdminClient.acl_targets)
    cluster = blocking(_admin.AdminClient.cluster)
    topic_route = blocking(_admin.AdminClient.topic_route)
    runtime_infos = blocking(_admin.AdminClient.runtime_infos)
    wait_consumed = blocking(_admin.AdminClient.wait_consumed)


def wait_consumed(
    msg_id_or_key: str,
    group: str,
    address: str | None = None,
    *,
    timeout: float = 10.0,
    poll_interval: float = 0.05,
    **client: Any,
) -> MessageExt:
    """The blocking twin of :func:`txmq.wait_consumed` (see
    :meth:`txmq.admin.AdminClient.wait_consumed`)."""
    with AdminClient(address, **client) as admin:
        return admin.wait_consumed(
            msg_id_or_key, group, timeout=timeout, poll_interval=poll_interval
        )


class PushConsumer(SyncClient[_push.PushConsumer]):
    """Blocking push consumer; the listener may be a plain function (it runs in worker
    threads) or a coroutine function, with the same results (``raise txmq.DeadLetter``
    included). Same arguments as :class:`txmq.push.PushConsumer`::

        consumer = txmq.sync.PushConsumer(address, "billing", listener=handle)
        consumer.subscribe("orders", "created || paid")
        with consumer:
            ...  # messages are consumed in the background until the block ends
    """

    def __init__(self, address: str | None = None, group: str = "DEFAULT_CONSUMER", **kw: Any):
        super().__init__(_push.PushConsumer(address, group, **kw))

    def subscribe(self, topic: str, expression: str = "*") -> None:
        self.aio.subscribe(topic, expression)

    def register_listener(self, listener: _push.Listener) -> None:
        self.aio.register_listener(listener)

    def queues_held(self) -> list[MessageQueue]:
        return sorted(self.aio.queues_held)
