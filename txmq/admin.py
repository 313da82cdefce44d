"""Operator queries: topics, queue statistics, message lookups, group offsets, the DLQ,
undecided transactions."""

from __future__ import annotations

from txmq.client import BrokerClient
from txmq.codec import decode_record, decode_records
from txmq.message import MessageExt
from txmq.wire import (
    DeleteTopic,
    DlqList,
    DlqResend,
    GetAllConsumerOffsets,
    GetAllTopicConfig,
    GetBrokerRuntimeInfo,
    GetTopicStats,
    GetTransactions,
    GroupOffset,
    QueryMessageByKey,
    QueueStats,
    RuntimeInfo,
    TopicInfo,
    TopicRow,
    TransactionRow,
    UpdateAndCreateTopic,
    ViewMessageById,
)

__all__ = ["AdminClient"]


class AdminClient(BrokerClient):
    async def topics(self) -> list[TopicRow]:
        return (await self.call(GetAllTopicConfig())).topics

    async def topic_stats(self, topic: str) -> list[QueueStats]:
        return (await self.call(GetTopicStats(topic=topic))).queues

    async def create_topic(self, topic: str, queue_nums: int) -> TopicInfo:
        return await self.call(UpdateAndCreateTopic(topic=topic, queue_nums=queue_nums))

    async def delete_topic(self, topic: str) -> None:
        await self.call(DeleteTopic(topic=topic))

    async def message_by_id(self, msg_id: str) -> MessageExt:
        answer = await self.call_with_body(ViewMessageById(msg_id=msg_id))
        return decode_record(answer.body, verify=True)

    async def messages_by_key(self, key: str, max_num: int = 32) -> list[MessageExt]:
        answer = await self.call_with_body(QueryMessageByKey(key=key, max_num=max_num))
        return decode_records(answer.body)

    async def offsets(self) -> list[GroupOffset]:
        return (await self.call(GetAllConsumerOffsets())).offsets

    async def runtime_info(self) -> RuntimeInfo:
        return await self.call(GetBrokerRuntimeInfo())

    async def dlq_list(self, group: str, offset: int = 0, max: int = 32) -> list[MessageExt]:
        """Up to ``max`` dead letters of consumer group ``group`` from queue offset ``offset``.

        Each message's topic is ``%DLQ%<group>``; its RETRY_TOPIC property names the topic
        it was first sent to.  An empty list if the group has no dead letters.
        """
        answer = await self.call_with_body(DlqList(group=group, offset=offset, max=max))
        return decode_records(answer.body) if answer.body else []

    async def dlq_resend(self, group: str, msg_ids: list[str] | None = None) -> int:
        """Store dead letters again in ``%RETRY%<group>`` (no delay, reconsume times 0).

        ``msg_ids=None`` re-sends every dead letter of the group.  The DLQ keeps its copy:
        re-sending a message twice delivers it twice.  Returns how many were re-sent.
        """
        if msg_ids is not None and not msg_ids:
            return 0
        if msg_ids is None:
            request = DlqResend(group=group, all=True)
        else:
            request = DlqResend(group=group, msg_ids=list(msg_ids))
        return (await self.call(request)).resent

    async def transactions(
        self, state: str = "pending", max: int = 100, *, group: str | None = None
    ) -> list[TransactionRow]:
        """Half messages still undecided (``"pending"``) or parked after the last check
        (``"parked"``), oldest first (parked ones with their ``parked_timestamp``)."""
        if state == "pending":
            request = GetTransactions(state="pending", max=max, group=group)
        elif state == "parked":
            request = GetTransactions(state="parked", max=max, group=group)
        else:
            raise ValueError("state must be 'pending' or 'parked'")
        return (await self.call(request)).transactions
