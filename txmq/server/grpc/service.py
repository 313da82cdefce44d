"""``apache.rocketmq.v2.MessagingService`` over a :class:`~txmq.server.grpc.ports.BrokerCore`.

Every RPC calls the core — the broker's own services (sending, transactions, the pop
consumption of ``txmq.broker.consumption.pop``), or a proxy's calls to the cluster's brokers
over txmq's protocol; this module and its parts (:mod:`.sending`, :mod:`.receiving`) only
translate.  A failed request answers a RocketMQ status code
(:func:`txmq.server.grpc.convert.status_of`), never a gRPC error; the RPCs txmq does not
serve answer ``NOT_IMPLEMENTED`` saying so.

Under access control every RPC is signed and checked (:mod:`txmq.server.grpc.access`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from txmq.protocol.wire import GetTopicRoute
from txmq.protocol.wire.errors import AuthenticationFailed, NoPermission, TxmqError
from txmq.security.acl.grpc_auth import GrpcPeer
from txmq.server.grpc.access import Access, pull
from txmq.server.grpc.answering import Endpoint, answers, client_id
from txmq.server.grpc.convert import duration, resource_name, status, status_of
from txmq.server.grpc.ports import ASKED, QueueSet
from txmq.server.grpc.receiving import DEFAULT_LONG_POLLING_MS, MAX_RECEIVE_BATCH, Receiving
from txmq.server.grpc.sending import Sending
from txmq.server.grpc.telemetry import Session

if TYPE_CHECKING:
    from txmq.security.acl.policy import User

__all__ = ["MessagingService"]

log = logging.getLogger("txmq.grpc")

ACCEPTED_TYPES = (pb.NORMAL, pb.FIFO, pb.DELAY, pb.TRANSACTION)


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


class MessagingService(Sending, Receiving, spb_grpc.MessagingServiceServicer):  # type: ignore[misc]
    def __init__(self, endpoint: Endpoint) -> None:
        self.ep = endpoint
        self.core = endpoint.core
        #: access control (checks that all pass when it is off)
        self.access = Access(endpoint.core.guard, endpoint.sessions)

    # -- routes ---------------------------------------------------------------------------

    def _queue(self, topic: Any, queue_id: int, qs: QueueSet, asked: Any) -> Any:
        if qs.readable and qs.writable:
            permission = pb.READ_WRITE
        else:
            permission = pb.READ if qs.readable else pb.WRITE if qs.writable else pb.NONE
        where = self.ep.endpoints(qs.address, asked if qs.address == ASKED else None)
        return pb.MessageQueue(
            topic=topic,
            id=queue_id,
            permission=permission,
            broker=pb.Broker(name=qs.broker_name, id=0, endpoints=where),
            accept_message_types=ACCEPTED_TYPES,
        )

    @answers(spb.QueryRouteResponse)
    async def QueryRoute(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "QueryRoute")
        topic = resource_name(request.topic, "topic")
        self.access.authorize(user, GetTopicRoute(topic=topic), peer, "QueryRoute")
        sets = await self.ep.routes.route(topic, True)
        asked = request.endpoints
        mqs = [
            self._queue(request.topic, i, qs, asked) for qs in sets for i in range(qs.queue_nums)
        ]
        return spb.QueryRouteResponse(status=status(), message_queues=mqs)

    @answers(spb.QueryAssignmentResponse)
    async def QueryAssignment(self, request: Any, context: Any) -> Any:
        # a pop reads every queue of the topic on one broker: one assignment per broker set
        user, peer = self.access.caller(context, "QueryAssignment")
        topic = resource_name(request.topic, "topic")
        group = resource_name(request.group, "group")
        self.access.authorize(user, pull(group, topic), peer, "QueryAssignment")
        sets = await self.ep.routes.route(topic, False)
        asked = request.endpoints
        assignments = [
            pb.Assignment(message_queue=self._queue(request.topic, -1, qs, asked))
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
                    session.push(await self._settings(session, command.settings, user, peer))
                # thread stack traces and verify results: nothing asked for them
        except Exception as exc:  # the stream broke: the session ends with it
            log.debug("telemetry stream of %s ended: %s", session.name, exc)
        finally:
            session.close()

    async def _settings(
        self,
        session: Session,
        settings: Any,
        user: User | None = None,
        peer: GrpcPeer | None = None,
    ) -> Any:
        """Take a client's settings, answer with the endpoint's (a consumer of a group its
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
            try:
                fifo, max_attempts = await self.ep.group_policy(group)
            except TxmqError as exc:  # (a proxy that reaches no broker now)
                return spb.TelemetryCommand(status=status_of(exc), settings=settings)
            answer.subscription.fifo = fifo
            answer.subscription.receive_batch_size = MAX_RECEIVE_BATCH
            answer.subscription.long_polling_timeout.CopyFrom(duration(DEFAULT_LONG_POLLING_MS))
            answer.backoff_policy.CopyFrom(self.ep.retry_policy(max_attempts))
        self.ep.sessions.settled(session)
        return spb.TelemetryCommand(status=status(), settings=answer)

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
