"""What a saga's coordinator and its participants have in common: a service name, a
transaction producer and the service's database sessions (async or blocking), and the
push consumer that feeds them."""

from __future__ import annotations

import inspect
from typing import Any

from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import sessionmaker

from txmq.consumer.model import ConsumeFrom
from txmq.protocol.message import MessageExt
from txmq.saga.model import MAX_RETRIES, check_name

__all__ = ["SagaService"]


class SagaService:
    """``producer``: a transaction producer — async ``txmq.TransactionProducer`` with an
    ``async_sessionmaker``, or ``txmq.sync.TransactionProducer`` with a ``sessionmaker`` —
    whose listener answers check-backs from the transaction log
    (``txmq.sqla.SqlTransactionChecker``)."""

    #: the consumer group and topic, from the service's name
    group_format = "saga-{}"
    topic_format = "saga-{}"

    def __init__(self, service: str, producer: Any, sessions: Any) -> None:
        self.service = check_name(f"a {type(self).__name__.lower()}'s service", service)
        if isinstance(sessions, async_sessionmaker):
            self.is_async = True
        elif isinstance(sessions, sessionmaker):
            self.is_async = False
        else:
            raise TypeError(
                f"sessions must be a sessionmaker or an async_sessionmaker, not {sessions!r}"
            )
        self.producer = producer
        self.sessions = sessions

    @property
    def topic(self) -> str:
        """The topic its messages come on."""
        return self.topic_format.format(self.service)

    @property
    def group(self) -> str:
        """Its consumer group."""
        return self.group_format.format(self.service)

    def consumer_options(self) -> dict[str, Any]:
        """The arguments of the push consumer that runs it (then ``subscribe(topic)``):
        ``txmq.PushConsumer(**options)`` when async, ``txmq.sync.PushConsumer`` else."""
        return {
            "group": self.group,
            # async: a coroutine function, run on the consumer's loop (a plain function that
            # returns a coroutine would cost a worker thread's round trip per message)
            "listener": self.listen if self.is_async else self.listener,
            "consume_from": ConsumeFrom.FIRST_OFFSET,
            "max_reconsume_times": MAX_RETRIES,
        }

    def listener(self, msg: MessageExt) -> Any:
        """The consumer's listener: a result, or (async) a coroutine of one."""
        raise NotImplementedError

    async def listen(self, msg: MessageExt) -> Any:
        """:meth:`listener` as a coroutine function (async mode)."""
        result = self.listener(msg)
        return await result if inspect.isawaitable(result) else result
