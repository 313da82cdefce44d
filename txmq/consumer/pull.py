"""Pulling messages from a queue at an offset, with long polling, and group offsets.

This is the layer the push consumer sits on: it knows nothing of rebalancing or process
queues, only how to fetch a batch and how to commit and query a group's offsets.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from txmq.client.core import BrokerClient
from txmq.protocol.codec import CorruptRecord, decode_records
from txmq.protocol.message import MessageExt, MessageQueue, tag_hash
from txmq.protocol.wire import (
    GetMaxOffset,
    GetMinOffset,
    PullMessage,
    QueryConsumerOffset,
    UpdateConsumerOffset,
)
from txmq.protocol.wire.errors import BrokerUnavailable

__all__ = ["PullConsumer", "PullResult", "PullStatus", "Puller", "subscription_tags"]

log = logging.getLogger("txmq.pull")


class PullStatus(enum.StrEnum):
    FOUND = "FOUND"
    NO_NEW_MSG = "NO_NEW_MSG"
    NO_MATCHED_MSG = "NO_MATCHED_MSG"
    OFFSET_ILLEGAL = "OFFSET_ILLEGAL"


@dataclass(slots=True)
class PullResult:
    status: PullStatus
    next_offset: int
    min_offset: int
    max_offset: int
    messages: list[MessageExt] = field(default_factory=list)


def subscription_tags(expression: str | None) -> set[str] | None:
    """The tags of ``"tagA || tagB"``; ``None`` means every message (``"*"``)."""
    if expression is None or expression.strip() in ("", "*"):
        return None
    return {t.strip() for t in expression.split("||") if t.strip()}


class Puller:
    """Pulls for consumer group ``group`` through a client's connections: a batch from a
    queue at an offset, and the group's offsets.  The pull consumer is one client with a
    puller; the push consumer holds one too."""

    def __init__(self, client: BrokerClient, group: str) -> None:
        self.client = client
        self.group = group
        #: the queues a broker advised to read from a slave next (topic, broker, queue id)
        self._from_slave: dict[tuple[str, str | None, int], bool] = {}

    async def pull(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        *,
        max_msgs: int = 32,
        subscription: str = "*",
        long_poll: float = 15.0,
        broker_name: str | None = None,
    ) -> PullResult:
        """Fetch up to ``max_msgs`` messages from ``offset`` (of the queue of broker set
        ``broker_name``: see :meth:`~txmq.client.core.BrokerClient.message_queues`; None:
        the broker given directly).

        With nothing to read, the broker holds the request up to ``long_poll`` seconds and
        answers as soon as a message arrives (0 answers at once).  Tags are filtered on the
        broker by hash and confirmed here by name.
        """
        client = self.client
        request = PullMessage(
            group=self.group,
            topic=topic,
            queue_id=queue_id,
            offset=offset,
            max_msgs=max_msgs,
            suspend_ms=int(long_poll * 1000),
            subscription=subscription,
        )
        key = (topic, broker_name, queue_id)
        from_slave = self._from_slave.get(key, False)
        try:
            pulled, body = await client.call_with_body(
                request,
                timeout=long_poll + client.request_timeout,
                broker=broker_name,
                replica="slave" if from_slave else "any",
            )
        except BrokerUnavailable as exc:
            if from_slave or not broker_name:
                raise
            # the master is down (its route not refreshed yet): read from a slave (a read
            # may be asked again)
            mq = MessageQueue(topic, broker_name, queue_id)
            client.routes.failed(mq, unreachable=not exc.sent)
            pulled, body = await client.call_with_body(
                request,
                timeout=long_poll + client.request_timeout,
                broker=broker_name,
                replica="slave",
            )
        if broker_name:  # the broker's advice for the next pull (RocketMQ's suggestWhichBrokerId)
            self._from_slave[key] = pulled.suggest_broker_id != 0
        messages = decode_records(body, on_corrupt=_corrupt(topic, queue_id)) if body else []
        if broker_name:
            for m in messages:
                m.broker_name = broker_name
        tags = subscription_tags(subscription)
        if tags is not None:
            codes = {tag_hash(t) for t in tags}
            messages = [m for m in messages if m.tags in tags and tag_hash(m.tags) in codes]
        status = PullStatus(pulled.status)
        if status == PullStatus.FOUND and not messages:
            status = PullStatus.NO_MATCHED_MSG
        return PullResult(
            status, pulled.next_offset, pulled.min_offset, pulled.max_offset, messages
        )

    async def commit_offset(
        self, topic: str, queue_id: int, offset: int, *, broker_name: str | None = None
    ) -> None:
        request = UpdateConsumerOffset(
            group=self.group, topic=topic, queue_id=queue_id, offset=offset
        )
        # the master; while the set has none, a slave keeps it and hands it back later
        await self.client.call(request, broker=broker_name, replica="any")

    async def fetch_offset(
        self, topic: str, queue_id: int, *, broker_name: str | None = None
    ) -> int:
        """The group's committed offset, or -1 if it never committed one."""
        request = QueryConsumerOffset(group=self.group, topic=topic, queue_id=queue_id)
        return (await self.client.call(request, broker=broker_name, replica="any")).offset

    async def max_offset(self, topic: str, queue_id: int, *, broker_name: str | None = None) -> int:
        request = GetMaxOffset(topic=topic, queue_id=queue_id)
        return (await self.client.call(request, broker=broker_name, replica="any")).offset

    async def min_offset(self, topic: str, queue_id: int, *, broker_name: str | None = None) -> int:
        request = GetMinOffset(topic=topic, queue_id=queue_id)
        return (await self.client.call(request, broker=broker_name, replica="any")).offset


def _corrupt(topic: str, queue_id: int) -> Callable[[int, CorruptRecord], None]:
    def skip(pos: int, exc: CorruptRecord) -> None:
        # the broker checks each record it serves: this one changed on its way here
        log.warning("pull %s/%d: skipped a damaged record (%s)", topic, queue_id, exc)

    return skip


class PullConsumer(BrokerClient, Puller):
    """Pull batches from queues and manage the offsets of consumer group ``group``: a
    client that is its own puller (see :class:`Puller` for its methods)."""

    def __init__(
        self, address: str | None = None, group: str = "DEFAULT_CONSUMER", **kwargs: Any
    ) -> None:
        BrokerClient.__init__(self, address, **kwargs)
        Puller.__init__(self, self, group)
