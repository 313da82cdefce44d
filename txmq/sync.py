"""Synchronous facades over the async clients (one copy of the logic: the async one).

Each facade runs its async client on an event loop in a background thread (an anyio
blocking portal) and keeps the client's whole lifetime inside one task there::

    with txmq.sync.Producer("127.0.0.1:10911") as producer:
        result = producer.send(Message("orders", b"..."))
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, Self, TypeVar

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal, start_blocking_portal

from txmq import admin as _admin
from txmq import producer as _producer
from txmq import pull as _pull
from txmq import push as _push
from txmq import transaction as _tx
from txmq.message import Message, MessageExt, new_message_id

__all__ = [
    "AdminClient",
    "Producer",
    "PullConsumer",
    "PushConsumer",
    "SyncClient",
    "TransactionProducer",
]

class AsyncLifecycle(Protocol):
    """What a facade can run: an object used as ``async with obj: ...``."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: Any) -> Any: ...


C = TypeVar("C", bound=AsyncLifecycle)
R = TypeVar("R")


class SyncClient(Generic[C]):
    """Runs ``client`` (an async client, or anything with ``async with``) for its whole
    lifetime in one task of an event loop in a background thread; ``_call`` runs its
    coroutine methods there."""

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
        if self._portal is None:
            raise RuntimeError("client is not started: call start() or use 'with'")
        return self._portal.call(functools.partial(fn, *args, **kwargs))


class Producer(SyncClient[_producer.Producer]):
    """Blocking producer; same arguments as :class:`txmq.producer.Producer`."""

    def __init__(self, address: str | None = None, group: str = "DEFAULT_PRODUCER", **kw: Any):
        super().__init__(_producer.Producer(address, group, **kw))

    def send(self, msg: Message, **kwargs: Any) -> _producer.SendResult:
        result: _producer.SendResult = self._call(self.aio.send, msg, **kwargs)
        return result

    def send_async(
        self, msg: Message, callback: _producer.SendCallback | None = None, **kwargs: Any
    ) -> None:
        self._call(_wrap_sync(self.aio.send_async), msg, callback, **kwargs)

    def send_oneway(self, msg: Message, **kwargs: Any) -> None:
        self._call(self.aio.send_oneway, msg, **kwargs)

    def send_batch(self, msgs: Sequence[Message], **kwargs: Any) -> _producer.SendResult:
        result: _producer.SendResult = self._call(self.aio.send_batch, msgs, **kwargs)
        return result


class TransactionProducer(SyncClient[_tx.TransactionProducer]):
    """Blocking transactional producer; same arguments as
    :class:`txmq.transaction.TransactionProducer`.

    ``send_message_in_transaction`` runs ``execute_local_transaction`` in the calling thread
    (so thread-bound sessions work); check-backs run in worker threads (plain functions) or
    on the client's event loop (coroutine functions).
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

    def send(self, msg: Message, **kwargs: Any) -> _producer.SendResult:
        result: _producer.SendResult = self._call(self.aio.send, msg, **kwargs)
        return result

    def send_half(self, msg: Message, **kwargs: Any) -> _producer.SendResult:
        result: _producer.SendResult = self._call(self.aio.send_half, msg, **kwargs)
        return result

    def end_transaction(
        self,
        result: _producer.SendResult,
        state: _tx.LocalTransactionState | str,
        *,
        from_check: bool = False,
    ) -> str:
        answer: str = self._call(self.aio.end_transaction, result, state, from_check=from_check)
        return answer

    def send_message_in_transaction(
        self,
        msg: Message,
        arg: Any = None,
        *,
        transaction_id: str | None = None,
        **send_kw: Any,
    ) -> _tx.TransactionSendResult:
        """Like the async one, with the local transaction run in this thread."""
        listener = self.aio.listener
        if listener is None:
            raise ValueError("set a TransactionListener before sending in a transaction")
        tx_id = transaction_id or new_message_id()
        result = self.send_half(msg, transaction_id=tx_id, **send_kw)
        try:
            execute = listener.execute_local_transaction
            if inspect.iscoroutinefunction(execute):
                value = self._call(execute, msg, arg)
            else:
                value = execute(msg, arg)
                if inspect.isawaitable(value):
                    value = self._call(_tx._await, value)
            state = _tx.to_state(value)
        except Exception as exc:
            unknown = _tx.LocalTransactionState.UNKNOWN
            self._call(self.aio._end_after_local, result, tx_id, unknown, exc)
            raise
        self._call(self.aio._end_after_local, result, tx_id, state)
        return _tx.TransactionSendResult(result, tx_id, state)


class PullConsumer(SyncClient[_pull.PullConsumer]):
    def __init__(self, address: str | None = None, group: str = "DEFAULT_CONSUMER", **kw: Any):
        super().__init__(_pull.PullConsumer(address, group, **kw))

    def queues(self, topic: str) -> list[int]:
        result: list[int] = self._call(self.aio.queues, topic)
        return result

    def pull(self, topic: str, queue_id: int, offset: int, **kwargs: Any) -> _pull.PullResult:
        result: _pull.PullResult = self._call(self.aio.pull, topic, queue_id, offset, **kwargs)
        return result

    def commit_offset(self, topic: str, queue_id: int, offset: int) -> None:
        self._call(self.aio.commit_offset, topic, queue_id, offset)

    def fetch_offset(self, topic: str, queue_id: int) -> int:
        result: int = self._call(self.aio.fetch_offset, topic, queue_id)
        return result

    def max_offset(self, topic: str, queue_id: int) -> int:
        result: int = self._call(self.aio.max_offset, topic, queue_id)
        return result


class AdminClient(SyncClient[_admin.AdminClient]):
    def __init__(self, address: str | None = None, **kw: Any):
        super().__init__(_admin.AdminClient(address, **kw))

    def topics(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call(self.aio.topics)
        return result

    def topic_stats(self, topic: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call(self.aio.topic_stats, topic)
        return result

    def create_topic(self, topic: str, queue_nums: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call(self.aio.create_topic, topic, queue_nums)
        return result

    def message_by_id(self, msg_id: str) -> MessageExt:
        result: MessageExt = self._call(self.aio.message_by_id, msg_id)
        return result

    def messages_by_key(self, key: str, max_num: int = 32) -> list[MessageExt]:
        result: list[MessageExt] = self._call(self.aio.messages_by_key, key, max_num)
        return result

    def offsets(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call(self.aio.offsets)
        return result

    def runtime_info(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call(self.aio.runtime_info)
        return result

    def dlq_list(self, group: str, offset: int = 0, max: int = 32) -> list[MessageExt]:
        result: list[MessageExt] = self._call(self.aio.dlq_list, group, offset, max)
        return result

    def dlq_resend(self, group: str, msg_ids: list[str] | None = None) -> int:
        result: int = self._call(self.aio.dlq_resend, group, msg_ids)
        return result

    def transactions(self, state: str = "pending", max: int = 100) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call(self.aio.transactions, state, max)
        return result


class PushConsumer(SyncClient[_push.PushConsumer]):
    """Blocking push consumer; the listener may be a plain function (it runs in worker
    threads) or a coroutine function. Same arguments as :class:`txmq.push.PushConsumer`::

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

    def queues_held(self) -> list[tuple[str, int]]:
        return sorted(self.aio.queues_held)


def _wrap_sync(fn: Callable[..., R]) -> Callable[..., Any]:
    """Run a plain function inside the portal's event loop (portal.call takes coroutines)."""

    async def call(*args: Any, **kwargs: Any) -> R:
        return fn(*args, **kwargs)

    return call
