"""ReceiveMessage, AckMessage, ChangeInvisibleDuration and ForwardMessageToDeadLetterQueue of
``apache.rocketmq.v2.MessagingService``: RocketMQ 5's pop consumption, through the core's
:class:`~txmq.server.grpc.ports.PopPort` (the broker's pop service, or a proxy's calls to
the broker set the client's assignment names)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb

from txmq.protocol.grpc_convert import DLQ_REASON_METADATA
from txmq.protocol.message import clip_reason, parse_subscription
from txmq.protocol.wire import ConsumerSendMsgBack
from txmq.protocol.wire.errors import BadRequest, TxmqError
from txmq.server.grpc.access import Access, pull
from txmq.server.grpc.answering import Endpoint, answers, settled
from txmq.server.grpc.convert import (
    GrpcError,
    duration_ms,
    message_of,
    now_ms,
    resource_name,
    status,
    status_of,
    timestamp,
)

__all__ = [
    "DEFAULT_INVISIBLE_MS",
    "DEFAULT_LONG_POLLING_MS",
    "MAX_LONG_POLLING_MS",
    "MAX_RECEIVE_BATCH",
    "Receiving",
]

MAX_RECEIVE_BATCH = 32
DEFAULT_INVISIBLE_MS = 30_000
DEFAULT_LONG_POLLING_MS = 20_000
MAX_LONG_POLLING_MS = 30_000


class Receiving:
    """The consuming RPCs (a part of :class:`txmq.server.grpc.service.MessagingService`)."""

    ep: Endpoint
    access: Access

    async def ReceiveMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            popped, topic = await self._pop(request, context)
        except (TxmqError, GrpcError) as exc:
            yield spb.ReceiveMessageResponse(status=status_of(exc))
            return
        if not popped:
            yield spb.ReceiveMessageResponse(status=status(pb.MESSAGE_NOT_FOUND, "no new message"))
            return
        host = self.ep.address()
        # when the broker handed them over: the client measures its receive latency by it
        yield spb.ReceiveMessageResponse(delivery_timestamp=timestamp(now_ms()))
        for p in popped:
            yield spb.ReceiveMessageResponse(
                message=message_of(
                    p.msg,
                    topic=topic,
                    handle=p.handle,
                    attempt=p.attempt,
                    invisible_ms=max(p.invisible_until_ms - now_ms(), 0),
                    store_host=host,
                )
            )
        yield spb.ReceiveMessageResponse(status=status())

    async def _pop(self, request: Any, context: Any) -> tuple[list[Any], Any]:
        user, peer = self.access.caller(context, "ReceiveMessage")
        group = resource_name(request.group, "group")
        topic = resource_name(request.message_queue.topic, "topic")
        self.access.authorize(user, pull(group, topic), peer, "ReceiveMessage")
        expr = request.filter_expression
        if expr.type == pb.SQL:
            raise GrpcError(pb.NOT_IMPLEMENTED, "SQL92 filters are not supported; filter by tag")
        expression = expr.expression or "*"
        try:
            tag_codes = parse_subscription(expression)
        except BadRequest as exc:
            raise GrpcError(pb.ILLEGAL_FILTER_EXPRESSION, str(exc)) from None
        batch = request.batch_size or MAX_RECEIVE_BATCH
        if not 1 <= batch <= MAX_RECEIVE_BATCH:
            raise GrpcError(pb.BAD_REQUEST, f"batch_size must be 1..{MAX_RECEIVE_BATCH}")
        invisible = (
            duration_ms(request.invisible_duration)
            if request.HasField("invisible_duration")
            else DEFAULT_INVISIBLE_MS
        )
        if invisible <= 0:
            raise GrpcError(pb.ILLEGAL_INVISIBLE_TIME, "invisible_duration must be positive")
        poll = (
            duration_ms(request.long_polling_timeout)
            if request.HasField("long_polling_timeout")
            else DEFAULT_LONG_POLLING_MS
        )
        if poll < 0:
            raise GrpcError(pb.ILLEGAL_POLLING_TIME, "long_polling_timeout must not be negative")
        fifo, max_attempts = await self.ep.group_policy(group)
        popped = await self.ep.pop.pop(
            broker=request.message_queue.broker.name,
            group=group,
            topic=topic,
            max_msgs=batch,
            invisible_ms=invisible,
            poll_ms=min(poll, MAX_LONG_POLLING_MS),
            expression=expression,
            tag_codes=tag_codes,
            fifo=fifo,
            max_attempts=max_attempts,
        )
        return popped, request.message_queue.topic

    @answers(spb.AckMessageResponse)
    async def AckMessage(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "AckMessage")
        group = resource_name(request.group, "group")
        topic = resource_name(request.topic, "topic")
        self.access.authorize(user, pull(group, topic), peer, "AckMessage")
        results = []
        for entry in request.entries:
            try:
                await settled(
                    self.ep.pop.ack(group=group, topic=topic, handle=entry.receipt_handle)
                )
                st = status()
            except (TxmqError, GrpcError) as exc:
                st = status_of(exc)
            results.append(
                spb.AckMessageResultEntry(
                    message_id=entry.message_id, receipt_handle=entry.receipt_handle, status=st
                )
            )
        codes = {r.status.code for r in results}
        if len(results) == 1 or len(codes) == 1:
            overall = results[0].status if results else status()
        else:
            overall = status(pb.MULTIPLE_RESULTS, "some entries failed")
        return spb.AckMessageResponse(status=overall, entries=results)

    @answers(spb.ChangeInvisibleDurationResponse)
    async def ChangeInvisibleDuration(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "ChangeInvisibleDuration")
        group = resource_name(request.group, "group")
        topic = resource_name(request.topic, "topic")
        self.access.authorize(user, pull(group, topic), peer, "ChangeInvisibleDuration")
        invisible = duration_ms(request.invisible_duration)
        if invisible <= 0:
            raise GrpcError(pb.ILLEGAL_INVISIBLE_TIME, "invisible_duration must be positive")
        popped = await settled(
            self.ep.pop.change_invisible(
                group=group, topic=topic, handle=request.receipt_handle, invisible_ms=invisible
            )
        )
        return spb.ChangeInvisibleDurationResponse(status=status(), receipt_handle=popped.handle)

    @answers(spb.ForwardMessageToDeadLetterQueueResponse)
    async def ForwardMessageToDeadLetterQueue(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "ForwardMessageToDeadLetterQueue")
        group = resource_name(request.group, "group")
        topic = resource_name(request.topic, "topic")
        back = ConsumerSendMsgBack(group=group, commit_log_offset=0)
        self.access.authorize(user, back, peer, "ForwardMessageToDeadLetterQueue")
        reason = ""
        for key, value in context.invocation_metadata() or ():
            if key == DLQ_REASON_METADATA and isinstance(value, bytes):
                reason = clip_reason(value.decode("utf-8", "replace"))
        await settled(
            self.ep.pop.dead_letter(
                group=group, topic=topic, handle=request.receipt_handle, reason=reason
            )
        )
        return spb.ForwardMessageToDeadLetterQueueResponse(status=status())
