"""Operator queries: topics, queue statistics, message lookups, group offsets, the DLQ,
undecided transactions."""

from __future__ import annotations

from typing import Any

from txmq.client import BrokerClient
from txmq.codec import decode_record, decode_records
from txmq.message import MessageExt
from txmq.protocol import RequestCode

__all__ = ["AdminClient"]


class AdminClient(BrokerClient):
    async def topics(self) -> list[dict[str, Any]]:
        frame = await self.request(RequestCode.GET_ALL_TOPIC_CONFIG)
        return list(frame.header["topics"])

    async def topic_stats(self, topic: str) -> list[dict[str, Any]]:
        frame = await self.request(RequestCode.GET_TOPIC_STATS, {"topic": topic})
        return list(frame.header["queues"])

    async def create_topic(self, topic: str, queue_nums: int) -> dict[str, Any]:
        frame = await self.request(
            RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic": topic, "queue_nums": queue_nums}
        )
        return dict(frame.header)

    async def delete_topic(self, topic: str) -> None:
        await self.request(RequestCode.DELETE_TOPIC, {"topic": topic})

    async def message_by_id(self, msg_id: str) -> MessageExt:
        frame = await self.request(RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": msg_id})
        return decode_record(frame.body, verify=True)

    async def messages_by_key(self, key: str, max_num: int = 32) -> list[MessageExt]:
        frame = await self.request(
            RequestCode.QUERY_MESSAGE_BY_KEY, {"key": key, "max_num": max_num}
        )
        return decode_records(frame.body)

    async def offsets(self) -> list[dict[str, Any]]:
        frame = await self.request(RequestCode.GET_ALL_CONSUMER_OFFSETS)
        return list(frame.header["offsets"])

    async def runtime_info(self) -> dict[str, Any]:
        frame = await self.request(RequestCode.GET_BROKER_RUNTIME_INFO)
        return dict(frame.header)

    async def dlq_list(self, group: str, offset: int = 0, max: int = 32) -> list[MessageExt]:
        """Up to ``max`` dead letters of consumer group ``group`` from queue offset ``offset``.

        Each message's topic is ``%DLQ%<group>``; its RETRY_TOPIC property names the topic
        it was first sent to.  An empty list if the group has no dead letters.
        """
        frame = await self.request(
            RequestCode.DLQ_LIST, {"group": group, "offset": offset, "max": max}
        )
        return decode_records(frame.body) if frame.body else []

    async def dlq_resend(self, group: str, msg_ids: list[str] | None = None) -> int:
        """Store dead letters again in ``%RETRY%<group>`` (no delay, reconsume times 0).

        ``msg_ids=None`` re-sends every dead letter of the group.  The DLQ keeps its copy:
        re-sending a message twice delivers it twice.  Returns how many were re-sent.
        """
        if msg_ids is not None and not msg_ids:
            return 0
        header: dict[str, Any] = {"group": group}
        if msg_ids is None:
            header["all"] = True
        else:
            header["msg_ids"] = list(msg_ids)
        frame = await self.request(RequestCode.DLQ_RESEND, header)
        return int(frame.header["resent"])

    async def transactions(
        self, state: str = "pending", max: int = 100, *, group: str | None = None
    ) -> list[dict[str, Any]]:
        """Half messages still undecided (``"pending"``) or parked after the last check
        (``"parked"``), oldest first: msg_id, transaction_id, group, topic, queue_id,
        transaction_offset, born_timestamp, check_times, age_s (parked ones also
        parked_timestamp)."""
        if state not in ("pending", "parked"):
            raise ValueError("state must be 'pending' or 'parked'")
        header: dict[str, Any] = {"state": state, "max": max}
        if group is not None:
            header["group"] = group
        frame = await self.request(RequestCode.GET_TRANSACTIONS, header)
        return list(frame.header["transactions"])
