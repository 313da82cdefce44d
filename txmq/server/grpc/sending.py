"""SendMessage and EndTransaction of ``apache.rocketmq.v2.MessagingService``: a RocketMQ 5
message becomes txmq's SendMessage (its properties, its kind), stored by the core — which
picks the queue: by message group, else round robin — and a half message's transaction id
names the broker set that holds it, unless that is the endpoint's own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb

from txmq.protocol.message import Prop, new_message_id
from txmq.protocol.rpc import Call
from txmq.protocol.wire import EndTransaction, SendMessage
from txmq.protocol.wire.errors import TxmqError
from txmq.security.acl.grpc_auth import GrpcPeer
from txmq.server.grpc.access import Access
from txmq.server.grpc.answering import Endpoint, answers, settled
from txmq.server.grpc.convert import (
    BORN_HOST,
    GrpcError,
    duration_ms,
    ms_of,
    resource_name,
    status,
    status_of,
)
from txmq.server.grpc.ports import BrokerCore
from txmq.server.grpc.telemetry import parse_transaction_id, transaction_id

if TYPE_CHECKING:
    from txmq.security.acl.policy import User

__all__ = ["Sending"]

_SLAVE_CODES = {
    "FLUSH_SLAVE_TIMEOUT": pb.SLAVE_PERSISTENCE_TIMEOUT,
    "SLAVE_NOT_AVAILABLE": pb.HA_NOT_AVAILABLE,
}


class Sending:
    """The sending RPCs (a part of :class:`txmq.server.grpc.service.MessagingService`)."""

    ep: Endpoint
    core: BrokerCore
    access: Access

    @answers(spb.SendMessageResponse)
    async def SendMessage(self, request: Any, context: Any) -> Any:
        if not request.messages:
            raise GrpcError(pb.BAD_REQUEST, "SendMessage carries no message")
        user, peer = self.access.caller(context, "SendMessage")
        entries = [await self._send_one(m, user, peer) for m in request.messages]
        first_failed = next((e.status for e in entries if e.status.code != pb.OK), None)
        return spb.SendMessageResponse(status=first_failed or status(), entries=entries)

    async def _send_one(self, m: Any, user: User | None, peer: GrpcPeer) -> Any:
        try:
            # allowed before anything else (the topic may be auto-created)
            topic = resource_name(m.topic, "topic")
            self.access.authorize(user, SendMessage(topic=topic, queue_id=0), peer, "SendMessage")
            req = send_request(topic, m)
            who = user.name if user is not None else None
            broker, sent = await self.core.send(req, bytes(m.body), who)
        except (TxmqError, GrpcError) as exc:
            return spb.SendResultEntry(status=status_of(exc))
        code = _SLAVE_CODES.get(sent.status, pb.OK)
        own = "" if broker == self.core.broker_name else broker
        return spb.SendResultEntry(
            status=status(code, sent.status or "OK"),
            message_id=sent.msg_id,
            transaction_id=transaction_id(sent.transaction_offset, own)
            if sent.transaction_offset >= 0
            else "",
            offset=sent.queue_offset,
        )

    @answers(spb.EndTransactionResponse)
    async def EndTransaction(self, request: Any, context: Any) -> Any:
        user, peer = self.access.caller(context, "EndTransaction")
        try:
            broker, offset = parse_transaction_id(request.transaction_id)
        except ValueError:
            raise GrpcError(
                pb.INVALID_TRANSACTION_ID,
                f"transaction id {request.transaction_id!r} was not given by this endpoint",
            ) from None
        broker = broker or self.core.broker_name
        group = await settled(self.core.half_group(broker, offset, request.topic.name))
        state = {pb.COMMIT: "COMMIT", pb.ROLLBACK: "ROLLBACK"}.get(request.resolution, "UNKNOWN")
        req = EndTransaction(
            group=group or "-",
            transaction_offset=offset,
            state=state,  # type: ignore[arg-type]
            msg_id=request.message_id,
            from_check=request.source == pb.SOURCE_SERVER_CHECK,
        )
        self.access.authorize(user, req, peer, "EndTransaction")
        # the transaction service checks the user against the half's sender (reading only
        # the Peer side of the call's connection: its name and attributes)
        call = None if user is None else Call(cast(Any, peer), b"", user)
        await settled(self.core.end_transaction(broker, req, call))
        return spb.EndTransactionResponse(status=status())


def send_request(topic: str, m: Any) -> SendMessage:
    """txmq's request for RocketMQ 5 message ``m`` (queue_id -1: the core picks the queue);
    GrpcError for what RocketMQ 5 refuses."""
    sp = m.system_properties
    if not m.body:
        raise GrpcError(pb.MESSAGE_BODY_EMPTY, "the message body is empty")
    props: dict[str, str] = {}
    for name, value in m.user_properties.items():
        if name in Prop.ALL or name.startswith("__"):
            raise GrpcError(pb.ILLEGAL_MESSAGE_PROPERTY_KEY, f"property name {name!r} is reserved")
        props[name] = value
    props[Prop.UNIQ_KEY] = sp.message_id or new_message_id()
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
        props[Prop.SHARDING_KEY] = sp.message_group  # = txmq's sharding key
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
    return SendMessage(topic=topic, queue_id=-1, properties=props, born_timestamp=born, group=group)
