"""A RocketMQ 5 gRPC endpoint as the "remote" of txmq's client core.

:class:`GrpcRemote` stands where the core uses a :class:`txmq.protocol.peer.RemotingClient`:
it takes the same typed requests (``call(request, body)``) and translates them into
``apache.rocketmq.v2.MessagingService`` RPCs — GetTopicRoute → QueryRoute, SendMessage /
SendBatchMessage → SendMessage, EndTransaction → EndTransaction, Heartbeat → Heartbeat,
UnregisterClient → NotifyClientTermination (once a stopping push consumer's running listeners
have finished: :meth:`txmq.transports.grpc.receiving.ReceiveMode.drain`) — and answers with txmq's
typed responses.  A request only txmq's protocol has raises :class:`UnsupportedRequest`
naming it.

It keeps one Telemetry stream open to the endpoint: the client's settings go first (a
producer: the topics it publishes; a consumer: its group and subscriptions), and a
``RecoverOrphanedTransactionCommand`` (check-back) arrives there; it becomes the same
:class:`CheckTransactionState` and half-message record txmq's broker would send, handed
to the client core's ``serve`` hook, whose EndTransaction comes back through :meth:`call`.

Consumption has no pull: :meth:`query_assignment`, :meth:`receive`, :meth:`ack` and
:meth:`change_invisible` serve :mod:`txmq.transports.grpc.receiving`.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import Any, cast

import grpc
import grpc.aio
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb

from txmq.protocol.codec import encode_message
from txmq.protocol.grpc_convert import (
    DLQ_REASON_METADATA,
    check_error,
    duration,
    error_of,
    from_proto,
    to_proto,
)
from txmq.protocol.message import Prop, clip_reason
from txmq.protocol.wire import (
    BatchResult,
    BrokerData,
    CheckTransactionState,
    Empty,
    Ended,
    EndTransaction,
    GetTopicRoute,
    Heartbeat,
    QueueData,
    Request,
    SendBatchMessage,
    SendMessage,
    Sent,
    TopicRoute,
    UnregisterClient,
    WithBody,
)
from txmq.protocol.wire.base import R
from txmq.protocol.wire.errors import (
    BrokerUnavailable,
    ServerError,
    TransactionNotFound,
    TxmqError,
    UnsupportedRequest,
)
from txmq.protocol.wire.route import MASTER_ID, PERM_READ, PERM_WRITE
from txmq.security.client import ClientSecurity
from txmq.transports.grpc.channel import Channel, rpc_error, settle
from txmq.transports.grpc.receiving import Received, ReceiveMode
from txmq.transports.port import ClientSide, Consuming

__all__ = ["GrpcRemote", "Received"]

log = logging.getLogger("txmq.grpc")

#: transactions whose id is remembered for EndTransaction (the oldest are forgotten first)
MAX_TRANSACTIONS = 100_000
_SLAVE_STATUS = {
    pb.SLAVE_PERSISTENCE_TIMEOUT: "FLUSH_SLAVE_TIMEOUT",
    pb.HA_NOT_AVAILABLE: "SLAVE_NOT_AVAILABLE",
}


class GrpcRemote(Channel):
    """One RocketMQ 5 gRPC endpoint as the core's remote (see the module's documentation)."""

    def __init__(
        self,
        address: str,
        side: ClientSide,
        *,
        connect_timeout: float = 3.0,
        security: ClientSecurity | None = None,
    ) -> None:
        super().__init__(address, side, connect_timeout=connect_timeout, security=security)
        #: txmq's transaction_offset (a number of this remote's) <-> (topic, the endpoint's id)
        self._tx_numbers = itertools.count(1)
        self._tx_by_id: dict[str, int] = {}
        self._tx_by_number: OrderedDict[int, tuple[str, str]] = OrderedDict()
        #: the push consumers' receive modes through this endpoint (drained at termination)
        self._receivers: list[ReceiveMode] = []

    # -- txmq's requests ---------------------------------------------------------------------

    async def call(
        self, request: Request[R], body: bytes = b"", *, timeout: float = 3.0
    ) -> WithBody[R]:
        """A txmq request, answered by the endpoint (see the module's documentation)."""
        answer: Any
        if isinstance(request, SendMessage):
            answer = await self._send(request, body, timeout)
        elif isinstance(request, SendBatchMessage):
            answer = await self._send_batch(request, body, timeout)
        elif isinstance(request, EndTransaction):
            answer = await self._end(request, timeout)
        elif isinstance(request, GetTopicRoute):
            answer = await self._route(request, timeout)
        elif isinstance(request, Heartbeat):
            answer = await self._heartbeat(request, timeout)
        elif isinstance(request, UnregisterClient):
            answer = await self._terminate(request, timeout)
        else:
            raise UnsupportedRequest(
                f"{type(request).__name__} is part of txmq's own protocol only: a RocketMQ 5 "
                f"gRPC endpoint ({self.address}) does not serve it (use transport='txmq' "
                "with the broker's txmq address)"
            )
        return WithBody(cast(R, answer), b"")

    async def send_oneway(self, request: Request[Any], body: bytes = b"") -> None:
        """Send without waiting for the answer (a failure is logged)."""
        tg = self._tg
        if tg is None:
            raise BrokerUnavailable("client is not started")
        await self.connection()

        async def send() -> None:
            try:
                await self.call(request, body)
            except TxmqError as exc:
                log.warning("oneway %s to %s failed: %s", type(request).__name__, self.address, exc)

        tg.start_soon(send)

    async def _route(self, request: GetTopicRoute, timeout: float) -> TopicRoute:
        answer = await self._unary(
            "QueryRoute",
            spb.QueryRouteRequest(
                topic=pb.Resource(name=request.topic),
                endpoints=pb.Endpoints(
                    scheme=pb.IPv4 if self.host[:1].isdigit() else pb.DOMAIN_NAME,
                    addresses=[pb.Address(host=self.host, port=self.port)],
                ),
            ),
            timeout,
        )
        check_error(answer.status, f"route of {request.topic}")
        reads: dict[str, int] = {}
        writes: dict[str, int] = {}
        for mq in answer.message_queues:
            name = mq.broker.name or "grpc"
            if mq.permission in (pb.READ, pb.READ_WRITE):
                reads[name] = max(reads.get(name, 0), mq.id + 1)
            if mq.permission in (pb.WRITE, pb.READ_WRITE):
                writes[name] = max(writes.get(name, 0), mq.id + 1)
        queues = []
        for name in sorted(reads.keys() | writes.keys()):
            perm = (PERM_READ if name in reads else 0) | (PERM_WRITE if name in writes else 0)
            queues.append(
                QueueData(
                    broker_name=name,
                    read_queue_nums=reads.get(name, 0),
                    write_queue_nums=writes.get(name, 0),
                    perm=perm,
                )
            )
        # every request goes to this endpoint (a RocketMQ 5 proxy routes to its brokers)
        brokers = [
            BrokerData(
                cluster="grpc", broker_name=q.broker_name, addresses={MASTER_ID: self.address}
            )
            for q in queues
        ]
        return TopicRoute(topic=request.topic, queues=queues, brokers=brokers)

    async def _declare(self, topic: str) -> None:
        """A producer publishes ``topic``: the endpoint learns it (its check-backs for the
        topic's halves come to this client) before the first send."""
        if topic not in self._topics:
            self._topics[topic] = None
            await self._send_settings()

    async def _send(self, request: SendMessage, body: bytes, timeout: float) -> Sent:
        await self._declare(request.topic)
        message = to_proto(request.topic, body, request.properties, born_ms=request.born_timestamp)
        answer = await self._unary(
            "SendMessage", spb.SendMessageRequest(messages=[message]), timeout
        )
        entry = answer.entries[0] if answer.entries else None
        if entry is None:
            check_error(answer.status, f"send to {request.topic}")
            raise ServerError(f"the gRPC endpoint {self.address} answered a send with no entry")
        status = _SLAVE_STATUS.get(entry.status.code, "")
        if not status:
            check_error(entry.status, f"send to {request.topic}")
        offset = -1
        if entry.transaction_id:
            offset = self._remember(request.topic, entry.transaction_id)
        return Sent(
            msg_id=entry.message_id,
            offset_msg_id=entry.message_id,
            queue_id=-1,  # the endpoint chose it; its answer does not say which
            queue_offset=entry.offset,
            store_timestamp=0,
            transaction_offset=offset,
            status=status,
        )

    async def _send_batch(
        self, request: SendBatchMessage, body: bytes, timeout: float
    ) -> BatchResult:
        await self._declare(request.topic)
        messages = []
        pos = 0
        for entry in request.messages:
            part = body[pos : pos + entry.size]
            pos += entry.size
            messages.append(
                to_proto(request.topic, part, entry.properties, born_ms=entry.born_timestamp)
            )
        answer = await self._unary(
            "SendMessage", spb.SendMessageRequest(messages=messages), timeout
        )
        check_error(answer.status, f"batch send to {request.topic}")
        statuses = {_SLAVE_STATUS.get(e.status.code, "") for e in answer.entries}
        ids = [e.message_id for e in answer.entries]
        return BatchResult(
            msg_ids=ids,
            offset_msg_ids=ids,
            queue_id=-1,
            queue_offset=answer.entries[0].offset if answer.entries else 0,
            store_timestamp=0,
            status=max(statuses) if statuses else "",
        )

    # -- transactions ------------------------------------------------------------------------

    def _remember(self, topic: str, transaction_id: str) -> int:
        """The number txmq's core knows the endpoint's transaction ``transaction_id`` by (its
        ``transaction_offset``: the same for every check-back of it)."""
        number = self._tx_by_id.get(transaction_id)
        if number is None:
            number = self._tx_by_id[transaction_id] = next(self._tx_numbers)
            self._tx_by_number[number] = (topic, transaction_id)
            while len(self._tx_by_number) > MAX_TRANSACTIONS:
                _, (_, old) = self._tx_by_number.popitem(last=False)
                self._tx_by_id.pop(old, None)
        return number

    def _forget(self, number: int) -> None:
        known = self._tx_by_number.pop(number, None)
        if known is not None:
            self._tx_by_id.pop(known[1], None)

    async def _end(self, request: EndTransaction, timeout: float) -> Ended:
        known = self._tx_by_number.get(request.transaction_offset)
        if known is None:
            raise TransactionNotFound(
                f"transaction {request.transaction_offset} of message {request.msg_id} was not "
                f"sent or checked through gRPC endpoint {self.address} by this client"
            )
        if request.state == "UNKNOWN":
            return Ended(result="UNKNOWN")
        topic, transaction_id = known
        commit = request.state == "COMMIT"
        answer = await self._unary(
            "EndTransaction",
            spb.EndTransactionRequest(
                topic=pb.Resource(name=topic),
                message_id=request.msg_id,
                transaction_id=transaction_id,
                resolution=pb.COMMIT if commit else pb.ROLLBACK,
                source=pb.SOURCE_SERVER_CHECK if request.from_check else pb.SOURCE_CLIENT,
            ),
            timeout,
        )
        check_error(answer.status, f"ending transaction of message {request.msg_id}")
        self._forget(request.transaction_offset)
        return Ended(result="COMMITTED" if commit else "ROLLED_BACK")

    def _check_back(self, command: Any) -> None:
        """A RecoverOrphanedTransactionCommand: the check-back txmq's broker would send."""
        msg = from_proto(command.message)
        topic = msg.topic
        heartbeat = self.side.heartbeat()
        group = heartbeat.producers[0] if heartbeat is not None and heartbeat.producers else ""
        if group:
            msg.all_properties[Prop.PRODUCER_GROUP] = group
        msg.all_properties[Prop.REAL_TOPIC] = topic
        msg.all_properties[Prop.REAL_QID] = str(msg.queue_id)
        number = self._remember(topic, command.transaction_id)
        check = CheckTransactionState(
            transaction_offset=number,
            msg_id=msg.msg_id,
            transaction_id=msg.all_properties.get(Prop.TRANSACTION_ID, ""),
            group=group,
            topic=topic,
            queue_id=msg.queue_id,
        )
        try:
            self.side.serve(check, encode_message(msg), self)
        except UnsupportedRequest as exc:
            log.warning("%s", exc)

    async def _heartbeat(self, request: Heartbeat, timeout: float) -> Empty:
        await self.connection()
        await self._send_settings()
        asks = [
            spb.HeartbeatRequest(group=pb.Resource(name=c.group), client_type=pb.SIMPLE_CONSUMER)
            for c in request.consumers
        ]
        if request.producers or not asks:
            asks.append(spb.HeartbeatRequest(client_type=pb.PRODUCER))
        for ask in asks:
            answer = await self._unary("Heartbeat", ask, timeout)
            check_error(answer.status, "heartbeat")
        return Empty()

    async def _terminate(self, request: UnregisterClient, timeout: float) -> Empty:
        # a stopping push consumer (its receiving stopped) first lets its running listeners
        # finish and settle their messages, while the channel is still open
        for receiver in self._receivers:
            if receiver.stopping and receiver.consumer.group in request.consumer_groups:
                await receiver.drain()
        for group in request.consumer_groups or [""]:
            ask = spb.NotifyClientTerminationRequest()
            if group:
                ask.group.name = group
            answer = await self._unary("NotifyClientTermination", ask, timeout)
            check_error(answer.status, "client termination")
        return Empty()

    # -- consumption (RocketMQ 5's receive / ack) --------------------------------------------

    def receiver(self, consumer: Consuming) -> ReceiveMode:
        """The push consumer's receive mode through this endpoint."""
        mode = ReceiveMode(consumer, self)
        self._receivers = [r for r in self._receivers if r.consumer is not consumer]
        self._receivers.append(mode)
        return mode

    async def query_assignment(self, topic: str, group: str, timeout: float) -> list[Any]:
        """The message queues of ``topic`` this endpoint assigns ``group`` to receive from."""
        answer = await self._unary(
            "QueryAssignment",
            spb.QueryAssignmentRequest(
                topic=pb.Resource(name=topic),
                group=pb.Resource(name=group),
                endpoints=pb.Endpoints(addresses=[pb.Address(host=self.host, port=self.port)]),
            ),
            timeout,
        )
        check_error(answer.status, f"assignment of {topic} to {group}")
        return [a.message_queue for a in answer.assignments]

    async def receive(
        self,
        group: str,
        queue: Any,
        expression: str,
        *,
        batch: int,
        invisible_s: float,
        long_poll_s: float,
        timeout: float,
    ) -> list[Received]:
        """Up to ``batch`` messages of ``queue`` (long polling up to ``long_poll_s``), each
        invisible to the group's other receives for ``invisible_s``."""
        await self.connection()
        request = spb.ReceiveMessageRequest(
            group=pb.Resource(name=group),
            message_queue=queue,
            filter_expression=pb.FilterExpression(type=pb.TAG, expression=expression or "*"),
            batch_size=batch,
            invisible_duration=duration(int(invisible_s * 1000)),
            auto_renew=False,
            long_polling_timeout=duration(int(long_poll_s * 1000)),
        )
        out: list[Received] = []
        call = self._stub.ReceiveMessage(
            request, metadata=self._metadata(), timeout=long_poll_s + timeout
        )
        try:
            async for answer in call:
                kind = answer.WhichOneof("content")
                if kind == "message":
                    m = answer.message
                    sp = m.system_properties
                    out.append(
                        Received(
                            from_proto(m), m.topic.name, sp.receipt_handle, sp.delivery_attempt or 1
                        )
                    )
                elif kind == "status" and answer.status.code not in (pb.OK, pb.MESSAGE_NOT_FOUND):
                    raise error_of(answer.status, f"receive from {queue.topic.name}")
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, "ReceiveMessage", self.address) from None
        except BaseException:  # cancelled (a stopping consumer): let grpc confirm it first
            await settle(call)
            raise
        return out

    async def ack(self, group: str, received: Received, timeout: float) -> None:
        answer = await self._unary(
            "AckMessage",
            spb.AckMessageRequest(
                group=pb.Resource(name=group),
                topic=pb.Resource(name=received.topic),
                entries=[
                    spb.AckMessageEntry(
                        message_id=received.msg.msg_id, receipt_handle=received.handle
                    )
                ],
            ),
            timeout,
        )
        check_error(answer.status, f"ack of {received.msg.msg_id}")

    async def forward_to_dlq(
        self, group: str, received: Received, reason: str, timeout: float
    ) -> None:
        """Send ``received`` to the group's dead-letter queue at once (its listener said
        DEAD_LETTER); the reason travels as metadata (:data:`DLQ_REASON_METADATA`: the
        request has no field for it), which txmq's endpoint keeps with the dead letter."""
        answer = await self._unary(
            "ForwardMessageToDeadLetterQueue",
            spb.ForwardMessageToDeadLetterQueueRequest(
                group=pb.Resource(name=group),
                topic=pb.Resource(name=received.topic),
                receipt_handle=received.handle,
                message_id=received.msg.msg_id,
                delivery_attempt=received.attempt,
                max_delivery_attempts=received.attempt,
            ),
            timeout,
            extra=((DLQ_REASON_METADATA, clip_reason(reason).encode()),) if reason else (),
        )
        check_error(answer.status, f"dead-lettering {received.msg.msg_id}")

    async def change_invisible(
        self, group: str, received: Received, invisible_s: float, timeout: float
    ) -> None:
        """Make ``received`` visible again after ``invisible_s`` (a retry's back-off, or a
        renewal while its listener still runs); its receipt handle is renewed."""
        answer = await self._unary(
            "ChangeInvisibleDuration",
            spb.ChangeInvisibleDurationRequest(
                group=pb.Resource(name=group),
                topic=pb.Resource(name=received.topic),
                receipt_handle=received.handle,
                invisible_duration=duration(max(int(invisible_s * 1000), 1)),
                message_id=received.msg.msg_id,
            ),
            timeout,
        )
        check_error(answer.status, f"changing the invisible time of {received.msg.msg_id}")
        if answer.receipt_handle:
            received.handle = answer.receipt_handle
