"""Pulling messages from a queue at an offset, with long polling, and group offsets.

This is the layer the push consumer sits on: it knows nothing of rebalancing or process
queues, only how to fetch a batch and how to commit and query a group's offsets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from txmq.client import BrokerClient
from txmq.codec import decode_records
from txmq.message import MessageExt, tag_hash
from txmq.wire import (
    GetMaxOffset,
    GetMinOffset,
    PullMessage,
    QueryConsumerOffset,
    UpdateConsumerOffset,
)

__all__ = ["PullConsumer", "PullResult", "PullStatus", "subscription_tags"]


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


class PullConsumer(BrokerClient):
    """Pull batches from queues and manage the offsets of consumer group ``group``."""

    def __init__(
        self, address: str | None = None, group: str = "DEFAULT_CONSUMER", **kwargs: Any
    ) -> None:
        super().__init__(address, **kwargs)
        self.group = group

    async def pull(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        *,
        max_msgs: int = 32,
        subscription: str = "*",
        long_poll: float = 15.0,
    ) -> PullResult:
        """Fetch up to ``max_msgs`` messages from ``offset``.

        With nothing to read, the broker holds the request up to ``long_poll`` seconds and
        answers as soon as a message arrives (0 answers at once).  Tags are filtered on the
        broker by hash and confirmed here by name.
        """
        request = PullMessage(
            group=self.group,
            topic=topic,
            queue_id=queue_id,
            offset=offset,
            max_msgs=max_msgs,
            suspend_ms=int(long_poll * 1000),
            subscription=subscription,
        )
        pulled, body = await self.call_with_body(
            request, timeout=long_poll + self.request_timeout
        )
        messages = decode_records(body) if body else []
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

    async def commit_offset(self, topic: str, queue_id: int, offset: int) -> None:
        await self.call(
            UpdateConsumerOffset(group=self.group, topic=topic, queue_id=queue_id, offset=offset)
        )

    async def fetch_offset(self, topic: str, queue_id: int) -> int:
        """The group's committed offset, or -1 if it never committed one."""
        request = QueryConsumerOffset(group=self.group, topic=topic, queue_id=queue_id)
        return (await self.call(request)).offset

    async def max_offset(self, topic: str, queue_id: int) -> int:
        return (await self.call(GetMaxOffset(topic=topic, queue_id=queue_id))).offset

    async def min_offset(self, topic: str, queue_id: int) -> int:
        return (await self.call(GetMinOffset(topic=topic, queue_id=queue_id))).offset
