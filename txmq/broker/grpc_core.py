"""The broker's side of RocketMQ 5's gRPC protocol: its services as the endpoint's
:class:`~txmq.server.grpc.ports.BrokerCore` (the endpoint itself, shared with the proxy, is
:mod:`txmq.server.grpc`; the ``txmq[grpc]`` extra), the same services txmq's protocol calls."""

from __future__ import annotations

from typing import Any

import msgspec

from txmq.broker.consumption.pop import Popped, PopService
from txmq.broker.consumption.retry import FIRST_RETRY_LEVEL
from txmq.broker.processor import Services
from txmq.broker.state.context import BrokerContext
from txmq.protocol.message import Prop, stable_hash
from txmq.protocol.wire import SendMessage
from txmq.protocol.wire.errors import TopicNotFound, TransactionNotFound
from txmq.server.grpc.answering import settled
from txmq.server.grpc.ports import BrokerCore, Stored
from txmq.server.grpc.routes import Routes

__all__ = ["BrokerPops", "broker_core"]


class BrokerPops:
    """The pop service as the endpoint's :class:`~txmq.server.grpc.ports.PopPort` (every
    queue of a topic on this broker is popped, whatever broker set the client names)."""

    def __init__(self, service: PopService) -> None:
        self.service = service

    async def pop(
        self,
        *,
        broker: str,
        group: str,
        topic: str,
        max_msgs: int,
        invisible_ms: int,
        poll_ms: int,
        expression: str,
        tag_codes: set[int] | None,
        fifo: bool,
        max_attempts: int,
    ) -> list[Popped]:
        return await self.service.pop(
            group=group,
            topic=topic,
            max_msgs=max_msgs,
            invisible_ms=invisible_ms,
            poll_ms=poll_ms,
            tag_codes=tag_codes,
            fifo=fifo,
            max_attempts=max_attempts,
        )

    def ack(self, *, group: str, topic: str, handle: str) -> None:
        self.service.ack(group=group, topic=topic, handle=handle)

    def change_invisible(self, *, group: str, topic: str, handle: str, invisible_ms: int) -> Any:
        return self.service.change_invisible(
            group=group, topic=topic, handle=handle, invisible_ms=invisible_ms
        )

    def dead_letter(self, *, group: str, topic: str, handle: str, reason: str = "") -> None:
        self.service.dead_letter(group=group, topic=topic, handle=handle, reason=reason)


def broker_core(ctx: BrokerContext, services: Services, pop: PopService) -> BrokerCore:
    """What the gRPC endpoint calls: the same services as txmq's protocol."""
    cfg, topics = ctx.config, ctx.topics
    name = cfg.broker_name
    turns: dict[str, int] = {}

    def queue_count(topic: str, create: bool) -> int:
        found = topics.get(topic)
        if found is None and create:
            found = topics.for_send(topic)  # TopicNotFound unless auto-created
        if found is None:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        return found.queue_nums

    async def send(req: SendMessage, body: bytes, user: str | None) -> Stored:
        queues = queue_count(req.topic, True)
        group = req.properties.get(Prop.SHARDING_KEY)
        if group:
            queue_id = stable_hash(group) % queues  # = txmq's sharding key
        else:
            turn = turns.get(req.topic, 0)
            turns[req.topic] = turn + 1
            queue_id = turn % queues
        put = services.sending.put(msgspec.structs.replace(req, queue_id=queue_id), body, user)
        return name, await settled(put)

    def half_group(broker: str, offset: int, topic: str) -> str:
        if broker != name:
            raise TransactionNotFound(
                f"the transaction is held by broker set {broker!r}: end it on that set's "
                f"endpoint, not on {name}'s"
            )
        half = services.transactions.half_at(offset)
        return half.all_properties.get(Prop.PRODUCER_GROUP, "")

    return BrokerCore(
        broker_name=name,
        host=cfg.host,
        grpc_port=cfg.grpc_port,
        advertised_address=cfg.grpc_advertised_address,
        max_message_size=cfg.max_message_size,
        max_frame_size=cfg.max_frame_size,
        retry_delays_ms=cfg.delay_levels[FIRST_RETRY_LEVEL - 1 :],
        routes=Routes(
            broker_name=name,
            namesrv=cfg.namesrv_addresses,
            queue_count=queue_count,
            security=cfg.peer_security(),
        ),
        send=send,
        half_group=half_group,
        end_transaction=lambda broker, req, call: services.transactions.end_transaction(req, call),
        pop=BrokerPops(pop),
        group_policy=ctx.groups.policy,
        producers=ctx.producers,
        tls=cfg.server_tls(),
        guard=ctx.guard,
    )
