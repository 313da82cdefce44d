"""``apache.rocketmq.v2.MessagingService`` over the broker's own services.

Every RPC calls the same typed services txmq's own protocol does (sending, transactions,
the pop consumption of :mod:`txmq.broker.consumption.pop`); this module only translates.  A failed
request answers a RocketMQ status code (:func:`txmq.broker.grpc.convert.status_of`), never
a gRPC error; the RPCs txmq does not serve answer ``NOT_IMPLEMENTED`` saying so.

Under access control every RPC is signed and checked (:mod:`txmq.broker.grpc.access`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from txmq.broker.grpc.access import Access, pull
from txmq.broker.grpc.convert import (
    BORN_HOST,
    GrpcError,
    duration,
    duration_ms,
    message_of,
    ms_of,
    now_ms,
    resource_name,
    status,
    status_of,
    timestamp,
)
from txmq.broker.grpc.ports import BrokerCore, PopPort
from txmq.broker.grpc.routes import QueueSet, Routes
from txmq.broker.grpc.telemetry import Session, Sessions, transaction_id
from txmq.protocol.grpc_convert import DLQ_REASON_METADATA
from txmq.protocol.message import Prop, clip_reason, parse_subscription, stable_hash
from txmq.protocol.rpc import Call
from txmq.protocol.wire import ConsumerSendMsgBack, EndTransaction, GetTopicRoute, SendMessage
from txmq.protocol.wire.errors import AuthenticationFailed, BadRequest, NoPermission, TxmqError
from txmq.security.acl.grpc_auth import GrpcPeer

if TYPE_CHECKING:
    from txmq.security.acl.policy import User

__all__ = ["MessagingService"]

log = logging.getLogger("txmq.broker.grpc")

T = TypeVar("T")

ACCEPTED_TYPES = (pb.NORMAL, pb.FIFO, pb.DELAY, pb.TRANSACTION)
MAX_RECEIVE_BATCH = 32
DEFAULT_INVISIBLE_MS = 30_000
DEFAULT_LONG_POLLING_MS = 20_000
MAX_LONG_POLLING_MS = 30_000
_SLAVE_CODES = {
    "FLUSH_SLAVE_TIMEOUT": pb.SLAVE_PERSISTENCE_TIMEOUT,
    "SLAVE_NOT_AVAILABLE": pb.HA_NOT_AVAILABLE,
}


def answers(
    response: Callable[..., Any],
) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """A unary RPC whose failures answer ``response(status=...)``."""

    def wrap(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(handler)
        async def call(self: MessagingService, request: Any, context: Any) -> Any:
            try:
                return await handler(self, request, context)
            except (TxmqError, GrpcError) as exc:
                return response(status=status_of(exc))
            except Exception as exc:
                log.exception("gRPC %s failed", handler.__name__)
                return response(status=status_of(exc))

        return call

    return wrap


async def settled(value: T | Awaitable[T]) -> T:
    """A service's answer, awaited when it is a future (SYNC flush, SYNC_MASTER)."""
    if isinstance(value, Awaitable):
        return await value
    return value


def client_id(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-mq-client-id":
            return str(value)
    return ""


def _not_served_unary(rpc: str, response: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """A unary RPC txmq does not serve: NOT_IMPLEMENTED, saying which."""

    async def handler(self: MessagingService, request: Any, context: Any) -> Any:
        try:
            self.access.caller(context, rpc)
        except AuthenticationFailed as exc:
            return response(status=status_of(exc))
        return response(status=_not_served(rpc))

    handler.__name__ = rpc
    return handler


class Endpoint(Protocol):
    """What the RPCs need of the endpoint that serves them
    (:class:`txmq.broker.grpc.endpoint.GrpcEndpoint`)."""

    core: BrokerCore
    pop: PopPort
    sessions: Sessions
    routes: Routes

    def address(self) -> str: ...

    def endpoints(self, address: str = "") -> Any: ...

    def group_policy(self, group: str) -> tuple[bool, int]: ...

    def retry_policy(self, max_attempts: int) -> Any: ...


class MessagingService(spb_grpc.MessagingServiceServicer):  # type: ignore[misc]
    def __init__(self, endpoint: Endpoint) -> None:
        self.ep = endpoint
        self.core = endpoint.core
        #: access control (checks that all pass when it is off)
        self.access = Access(endpoint.core.guard, endpoint.sessions)
        self._round_robin: dict[str, int] = {}

    # -- routes ---------------------------------------------------------------------------

    def _queue(self, topic: Any, queue_id: int, qs: QueueSet) -> Any:
        if qs.readable and qs.writable:
            permission = pb.READ_WRITE
        else:
            permission = pb.READ if qs.readable else pb.WRITE if qs.writable else pb.NONE
        return pb.MessageQueue(
            topic=topic,
            id=queue_id,
            permission=permission,
            broker=pb.Broker(name=qs.broker_name, id=0, endpoints=self.ep.endpoints(qs.address)),
            accept_message_types=ACCEPTED_TYPES,
        )

    def _topic(self, resource: Any, *, create: bool = True) -> tuple[str, int]:
        """A topic of this broker: its name and queue count."""
        name = resource_name(resource, "topic")
        return name, self.core.queue_count(name, create)

    @answers(spb.QueryRouteResponse)
    async def QueryRoute(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "QueryRoute")
        topic = resource_name(request.topic, "topic")
        self.access.authorize(user, GetTopicRoute(topic=topic), peer, "QueryRoute")
        sets = await self.ep.routes.route(topic, True)
        mqs = [self._queue(request.topic, i, qs) for qs in sets for i in range(qs.queue_nums)]
        return spb.QueryRouteResponse(status=status(), message_queues=mqs)

    @answers(spb.QueryAssignmentResponse)
    async def QueryAssignment(self, request: Any, context: Any) -> Any:
        # a pop reads every queue of the topic on one broker: one assignment per broker set
        user, peer = self.access.caller(context, "QueryAssignment")
        topic = resource_name(request.topic, "topic")
        group = resource_name(request.group, "group")
        self.access.authorize(user, pull(group, topic), peer, "QueryAssignment")
        sets = await self.ep.routes.route(topic, False)
        assignments = [
            pb.Assignment(message_queue=self._queue(request.topic, -1, qs))
            for qs in sets
            if qs.readable
        ]
        return spb.QueryAssignmentResponse(status=status(), assignments=assignments)

    # -- clients --------------------------------------------------------------------------

    @answers(spb.HeartbeatResponse)
    async def Heartbeat(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "Heartbeat")
        session = self.access.session(user, peer, client_id(context), "Heartbeat")
        if session is not None:
            self.ep.sessions.heartbeat(session)
        return spb.HeartbeatResponse(status=status())

    @answers(spb.NotifyClientTerminationResponse)
    async def NotifyClientTermination(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "NotifyClientTermination")
        cid = client_id(context)
        self.access.session(user, peer, cid, "NotifyClientTermination")
        self.ep.sessions.terminated(cid)
        return spb.NotifyClientTerminationResponse(status=status())

    async def Telemetry(self, request_iterator: Any, context: Any) -> None:
        cid = client_id(context)
        if not cid:
            await context.write(
                spb.TelemetryCommand(
                    status=status(pb.CLIENT_ID_REQUIRED, "header x-mq-client-id is missing")
                )
            )
            return
        try:  # the stream is authenticated once, when it opens
            user, peer = self.access.caller(context, "Telemetry")
            self.access.session(user, peer, cid, "Telemetry")
        except TxmqError as exc:
            await context.write(spb.TelemetryCommand(status=status_of(exc)))
            return
        session = self.ep.sessions.open(cid, str(context.peer()))
        if user is not None:
            session.attributes["acl_user"] = user.name
        reader = asyncio.ensure_future(self._read_telemetry(session, context, user, peer))
        try:
            while True:
                command = await session.queue.get()
                if command is None:
                    break
                await context.write(command)
        finally:
            reader.cancel()
            self.ep.sessions.close(session)

    async def _read_telemetry(
        self, session: Session, context: Any, user: User | None, peer: GrpcPeer
    ) -> None:
        import grpc.aio

        try:
            while True:
                command = await context.read()
                if command is grpc.aio.EOF:
                    break
                if command.HasField("settings"):
                    session.push(self._settings(session, command.settings, user, peer))
                # thread stack traces and verify results: nothing asked for them
        except Exception as exc:  # the stream broke: the session ends with it
            log.debug("telemetry stream of %s ended: %s", session.name, exc)
        finally:
            session.close()

    def _settings(
        self,
        session: Session,
        settings: Any,
        user: User | None = None,
        peer: GrpcPeer | None = None,
    ) -> Any:
        """Take a client's settings, answer with the broker's (a consumer of a group its
        user may not consume as: FORBIDDEN, its own settings echoed, nothing taken)."""
        if settings.HasField("subscription") and user is not None and peer is not None:
            try:
                self.access.may_subscribe(user, peer, settings.subscription)
            except NoPermission as exc:
                return spb.TelemetryCommand(status=status_of(exc), settings=settings)
        answer = pb.Settings()
        answer.CopyFrom(settings)
        session.client_type = settings.client_type
        if settings.HasField("publishing"):
            session.topics = [t.name for t in settings.publishing.topics if t.name]
            answer.publishing.max_body_size = self.core.max_message_size
            answer.publishing.validate_message_type = False
            answer.backoff_policy.CopyFrom(
                pb.RetryPolicy(
                    max_attempts=3,
                    exponential_backoff=pb.ExponentialBackoff(
                        initial=duration(10), max=duration(1000), multiplier=2.0
                    ),
                )
            )
        elif settings.HasField("subscription"):
            group = settings.subscription.group.name
            session.group = group
            fifo, max_attempts = self.ep.group_policy(group)
            answer.subscription.fifo = fifo
            answer.subscription.receive_batch_size = MAX_RECEIVE_BATCH
            answer.subscription.long_polling_timeout.CopyFrom(duration(DEFAULT_LONG_POLLING_MS))
            answer.backoff_policy.CopyFrom(self.ep.retry_policy(max_attempts))
        self.ep.sessions.settled(session)
        return spb.TelemetryCommand(status=status(), settings=answer)

    # -- sending --------------------------------------------------------------------------

    @answers(spb.SendMessageResponse)
    async def SendMessage(self, request: Any, context: Any) -> Any:
        if not request.messages:
            raise GrpcError(pb.BAD_REQUEST, "SendMessage carries no message")
        user, peer = self.access.caller(context, "SendMessage")
        entries = [await self._send_one(m, user, peer) for m in request.messages]
        first_failed = next((e.status for e in entries if e.status.code != pb.OK), None)
        return spb.SendMessageResponse(status=first_failed or status(), entries=entries)

    async def _send_one(self, m: Any, user: User | None, peer: GrpcPeer) -> Any:
        sp = m.system_properties
        try:
            # allowed before anything else (the topic may be auto-created)
            name = resource_name(m.topic, "topic")
            self.access.authorize(user, SendMessage(topic=name, queue_id=0), peer, "SendMessage")
            topic, queues = self._topic(m.topic)
            if not m.body:
                raise GrpcError(pb.MESSAGE_BODY_EMPTY, "the message body is empty")
            props: dict[str, str] = {}
            for name, value in m.user_properties.items():
                if name in Prop.ALL or name.startswith("__"):
                    raise GrpcError(
                        pb.ILLEGAL_MESSAGE_PROPERTY_KEY, f"property name {name!r} is reserved"
                    )
                props[name] = value
            props[Prop.UNIQ_KEY] = sp.message_id or _new_id()
            if sp.HasField("tag") and sp.tag:
                if "||" in sp.tag or not sp.tag.strip():
                    raise GrpcError(pb.ILLEGAL_MESSAGE_TAG, f"tag {sp.tag!r} is not allowed")
                props[Prop.TAGS] = sp.tag
            if sp.keys:
                props[Prop.KEYS] = " ".join(k for k in sp.keys if k)
            born = ms_of(sp.born_timestamp) if sp.HasField("born_timestamp") else 0
            kind = sp.message_type
            if sp.HasField("message_group") and sp.message_group:
                if kind == pb.TRANSACTION:
                    raise GrpcError(
                        pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
                        "a transactional message cannot have a message group",
                    )
                props[Prop.SHARDING_KEY] = sp.message_group
                queue_id = stable_hash(sp.message_group) % queues  # = txmq's sharding key
            else:
                n = self._round_robin.get(topic, 0)
                self._round_robin[topic] = n + 1
                queue_id = n % queues
            if sp.HasField("delivery_timestamp") and kind != pb.TRANSACTION:
                props[Prop.DELIVER_AT] = str(ms_of(sp.delivery_timestamp))
            if sp.born_host:
                props[BORN_HOST] = sp.born_host
            group = ""
            if kind == pb.TRANSACTION:
                props[Prop.TRAN_MSG] = "true"
                group = topic
                if sp.HasField("orphaned_transaction_recovery_duration"):
                    wait_s = duration_ms(sp.orphaned_transaction_recovery_duration) // 1000
                    props[Prop.CHECK_IMMUNITY_TIME_IN_SECONDS] = str(max(wait_s, 1))
            req = SendMessage(
                topic=topic, queue_id=queue_id, properties=props, born_timestamp=born, group=group
            )
            who = user.name if user is not None else None
            sent = await settled(self.core.put(req, bytes(m.body), who))
        except (TxmqError, GrpcError) as exc:
            return spb.SendResultEntry(status=status_of(exc))
        code = _SLAVE_CODES.get(sent.status, pb.OK)
        return spb.SendResultEntry(
            status=status(code, sent.status or "OK"),
            message_id=sent.msg_id,
            transaction_id=transaction_id(sent.transaction_offset)
            if sent.transaction_offset >= 0
            else "",
            offset=sent.queue_offset,
        )

    @answers(spb.EndTransactionResponse)
    async def EndTransaction(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "EndTransaction")
        try:
            offset = int(request.transaction_id, 16)
        except ValueError:
            raise GrpcError(
                pb.INVALID_TRANSACTION_ID,
                f"transaction id {request.transaction_id!r} was not given by this broker",
            ) from None
        half = self.core.half_at(offset)
        state = {pb.COMMIT: "COMMIT", pb.ROLLBACK: "ROLLBACK"}.get(request.resolution, "UNKNOWN")
        req = EndTransaction(
            group=half.all_properties.get(Prop.PRODUCER_GROUP, "") or "-",
            transaction_offset=offset,
            state=state,  # type: ignore[arg-type]
            msg_id=request.message_id,
            from_check=request.source == pb.SOURCE_SERVER_CHECK,
        )
        self.access.authorize(user, req, peer, "EndTransaction")
        # the transaction service checks the user against the half's sender (reading only
        # the Peer side of the call's connection: its name and attributes)
        call = None if user is None else Call(cast(Any, peer), b"", user)
        await settled(self.core.end_transaction(req, call))
        return spb.EndTransactionResponse(status=status())

    # -- receiving (pop) ------------------------------------------------------------------

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
        name = resource_name(request.message_queue.topic, "topic")
        self.access.authorize(user, pull(group, name), peer, "ReceiveMessage")
        topic, _ = self._topic(request.message_queue.topic, create=False)
        expr = request.filter_expression
        if expr.type == pb.SQL:
            raise GrpcError(pb.NOT_IMPLEMENTED, "SQL92 filters are not supported; filter by tag")
        try:
            tag_codes = parse_subscription(expr.expression or "*")
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
        fifo, max_attempts = self.ep.group_policy(group)
        popped = await self.ep.pop.pop(
            group=group,
            topic=topic,
            max_msgs=batch,
            invisible_ms=invisible,
            poll_ms=min(poll, MAX_LONG_POLLING_MS),
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
                self.ep.pop.ack(group=group, topic=topic, handle=entry.receipt_handle)
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
        popped = self.ep.pop.change_invisible(
            group=group, topic=topic, handle=request.receipt_handle, invisible_ms=invisible
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
        self.ep.pop.dead_letter(
            group=group, topic=topic, handle=request.receipt_handle, reason=reason
        )
        return spb.ForwardMessageToDeadLetterQueueResponse(status=status())

    # -- what txmq does not serve ---------------------------------------------------------

    async def PullMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            self.access.caller(context, "PullMessage")
        except AuthenticationFailed as exc:
            yield spb.PullMessageResponse(status=status_of(exc))
            return
        yield spb.PullMessageResponse(status=_not_served("PullMessage"))

    UpdateOffset = _not_served_unary("UpdateOffset", spb.UpdateOffsetResponse)
    GetOffset = _not_served_unary("GetOffset", spb.GetOffsetResponse)
    QueryOffset = _not_served_unary("QueryOffset", spb.QueryOffsetResponse)
    RecallMessage = _not_served_unary("RecallMessage", spb.RecallMessageResponse)
    SyncLiteSubscription = _not_served_unary(
        "SyncLiteSubscription", spb.SyncLiteSubscriptionResponse
    )


def _not_served(rpc: str) -> Any:
    return status(
        pb.NOT_IMPLEMENTED,
        f"{rpc} is not implemented by txmq's gRPC endpoint (RocketMQ 5 clients consume with "
        "ReceiveMessage/AckMessage; txmq's own clients pull over txmq's protocol)",
    )


def _new_id() -> str:
    from txmq.protocol.message import new_message_id

    return new_message_id()
