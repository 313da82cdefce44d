"""Operator queries: topics, queue statistics, message lookups, group offsets."""

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
