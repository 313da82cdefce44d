"""What a gRPC proxy (``txmq proxy start``) asks a broker over txmq's protocol, beside the
requests every client makes: RocketMQ 5's pop consumption (POP_MESSAGE, ACK_MESSAGE,
CHANGE_MESSAGE_INVISIBLETIME, POP_DEAD_LETTER and GET_SUBSCRIPTIONGROUP_CONFIG, by the pop
service of :mod:`txmq.broker.consumption.pop`) and several sends in one request
(SEND_MESSAGES, each stored as its own SendMessage would be).

A pop answers each message's stored record in the frame's body; the receipt handles are the
pop service's own (the proxy puts the broker set's name in front of them)."""

from __future__ import annotations

import asyncio

from txmq.broker.consumption.pop import PopService
from txmq.broker.sending import SendService
from txmq.broker.state.subscriptions import SubscriptionGroupManager
from txmq.protocol.codec import encode_message
from txmq.protocol.message import parse_subscription
from txmq.protocol.rpc import Call
from txmq.protocol.wire import (
    Acked,
    AckMessage,
    ChangeInvisibleTime,
    DeadLetterPopped,
    Empty,
    Failure,
    GetSubscriptionGroup,
    GroupConfigRow,
    PopMessage,
    PoppedEntry,
    PopResult,
    SendMessage,
    SendMessages,
    Sent,
    SentMany,
    WithBody,
)
from txmq.protocol.wire.errors import ResponseCode, TxmqError

__all__ = ["ProxyRequests"]


def _failure(index: int, exc: Exception) -> Failure:
    if isinstance(exc, TxmqError):
        return Failure(index=index, code=int(exc.code), error=str(exc))
    return Failure(index=index, code=int(ResponseCode.SYSTEM_ERROR), error=repr(exc))


class ProxyRequests:
    """The requests a gRPC proxy makes, as the router routes them."""

    def __init__(
        self, sending: SendService, pop: PopService, groups: SubscriptionGroupManager
    ) -> None:
        self.sending = sending
        self.pop_service = pop
        self.groups = groups

    # -- sending ----------------------------------------------------------------------------

    def send_many(self, req: SendMessages, call: Call) -> SentMany | asyncio.Future[SentMany]:
        user = call.user.name if call.user is not None else None
        body = memoryview(call.body)
        sent: list[Sent | None] = []
        failed: list[Failure] = []
        waiting: list[tuple[int, asyncio.Future[Sent]]] = []
        pos = 0
        for i, e in enumerate(req.messages):
            one = SendMessage(
                topic=req.topic,
                queue_id=e.queue_id,
                properties=e.properties,
                born_timestamp=e.born_timestamp,
                flag=e.flag,
                group=e.group,
            )
            chunk = bytes(body[pos : pos + e.size])
            pos += e.size
            try:
                result = self.sending.put(one, chunk, user)
            except Exception as exc:  # this one fails; the others are stored
                sent.append(None)
                failed.append(_failure(i, exc))
                continue
            if isinstance(result, asyncio.Future):  # SYNC flush, SYNC_MASTER
                waiting.append((i, result))
                sent.append(None)
            else:
                sent.append(result)
        if not waiting:
            return SentMany(sent=sent, failed=failed)
        return asyncio.ensure_future(self._settle(sent, failed, waiting))

    @staticmethod
    async def _settle(
        sent: list[Sent | None],
        failed: list[Failure],
        waiting: list[tuple[int, asyncio.Future[Sent]]],
    ) -> SentMany:
        for i, fut in waiting:
            try:
                sent[i] = await fut
            except Exception as exc:
                failed.append(_failure(i, exc))
        return SentMany(sent=sent, failed=sorted(failed, key=lambda f: f.index))

    # -- pop consumption --------------------------------------------------------------------

    async def pop(self, req: PopMessage, call: Call) -> WithBody[PopResult]:
        fifo, retries = self.groups.policy(req.group)
        popped = await self.pop_service.pop(
            group=req.group,
            topic=req.topic,
            max_msgs=req.max_msgs,
            invisible_ms=req.invisible_ms,
            poll_ms=req.poll_ms,
            tag_codes=parse_subscription(req.expression),
            fifo=fifo if req.fifo is None else req.fifo,
            max_attempts=retries + 1 if req.max_attempts is None else req.max_attempts,
        )
        entries: list[PoppedEntry] = []
        records: list[bytes] = []
        for p in popped:
            record = encode_message(p.msg)
            records.append(record)
            entries.append(
                PoppedEntry(
                    handle=p.handle,
                    attempt=p.attempt,
                    invisible_until_ms=p.invisible_until_ms,
                    size=len(record),
                )
            )
        return WithBody(PopResult(entries=entries), b"".join(records))

    def ack(self, req: AckMessage, call: Call) -> Acked:
        failed: list[Failure] = []
        for i, handle in enumerate(req.handles):
            try:
                self.pop_service.ack(group=req.group, topic=req.topic, handle=handle)
            except TxmqError as exc:
                failed.append(_failure(i, exc))
        return Acked(failed=failed)

    def change_invisible(self, req: ChangeInvisibleTime, call: Call) -> PoppedEntry:
        p = self.pop_service.change_invisible(
            group=req.group, topic=req.topic, handle=req.handle, invisible_ms=req.invisible_ms
        )
        return PoppedEntry(
            handle=p.handle, attempt=p.attempt, invisible_until_ms=p.invisible_until_ms
        )

    def dead_letter(self, req: DeadLetterPopped, call: Call) -> Empty:
        self.pop_service.dead_letter(
            group=req.group, topic=req.topic, handle=req.handle, reason=req.reason
        )
        return Empty()

    def group_config(self, req: GetSubscriptionGroup, call: Call) -> GroupConfigRow:
        fifo, retries = self.groups.policy(req.group)
        return GroupConfigRow(group=req.group, fifo=fifo, retry_max_times=retries)
