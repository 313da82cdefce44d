"""What the gRPC endpoint needs from the broker, as interfaces.

The endpoint stands on txmq's floor (messages, the wire types, errors) and on
:class:`BrokerCore`, which the broker (``broker/server.py``) fills with its own services:
the same typed calls txmq's protocol makes.  So the endpoint imports nothing of the broker
and the broker imports the endpoint, never the other way round.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from txmq.protocol.message import MessageExt
from txmq.protocol.wire import Ended, EndTransaction, SendMessage, Sent
from txmq.security.client import ClientSecurity
from txmq.security.tls import ServerTls

if TYPE_CHECKING:
    from txmq.protocol.rpc import Call
    from txmq.security.acl.guard import Guard

__all__ = ["BrokerCore", "PopPort", "Popped", "ProducerRegistry"]


class Popped(Protocol):
    """A message handed out by a pop (``txmq.broker.consumption.pop.Popped``)."""

    @property
    def msg(self) -> MessageExt: ...
    @property
    def handle(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def invisible_until_ms(self) -> int: ...


class PopPort(Protocol):
    """RocketMQ 5's pop consumption (``txmq.broker.consumption.pop.PopService``)."""

    async def pop(
        self,
        *,
        group: str,
        topic: str,
        max_msgs: int,
        invisible_ms: int,
        poll_ms: int,
        tag_codes: set[int] | None,
        fifo: bool,
        max_attempts: int,
    ) -> list[Any]: ...

    def ack(self, *, group: str, topic: str, handle: str) -> None: ...

    def change_invisible(
        self, *, group: str, topic: str, handle: str, invisible_ms: int
    ) -> Any: ...

    def dead_letter(self, *, group: str, topic: str, handle: str, reason: str = "") -> None: ...


class ProducerRegistry(Protocol):
    """The broker's producer groups (who gets a transaction's check-back)."""

    def register(self, group: str, client_id: str, conn: Any) -> None: ...
    def unregister(self, group: str, client_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class BrokerCore:
    """The broker as the endpoint sees it."""

    broker_name: str
    #: the cluster's name servers (none: the broker runs alone)
    namesrv: tuple[str, ...]
    #: where to listen (host, port: -1 for the default port) and what clients are told
    host: str
    grpc_port: int
    advertised_address: str
    max_message_size: int
    max_frame_size: int
    #: what a consumer waits between attempts (RocketMQ: delay levels 3 and on)
    retry_delays_ms: tuple[int, ...]
    #: a topic's queue count; ``create``: auto-create it if the broker does; else
    #: TopicNotFound
    queue_count: Callable[[str, bool], int]
    #: store one message (SendService.put; the user who sent it under access control,
    #: else None): its Sent, or a future of it
    put: Callable[[SendMessage, bytes, str | None], Sent | Awaitable[Sent]]
    #: the half message at a commit-log offset, or TransactionNotFound
    half_at: Callable[[int], MessageExt]
    #: end a half (TransactionService.end_transaction; the Call: who asks, under access
    #: control: the same check as txmq's protocol)
    end_transaction: Callable[[EndTransaction, Call | None], Ended | Awaitable[Ended]]
    pop: PopPort
    #: a consumer group's (FIFO?, retry max times)
    group_policy: Callable[[str], tuple[bool, int]]
    producers: ProducerRegistry
    #: TLS on the endpoint (the broker's tls_cert, tls_key, tls_ca; None: plaintext)
    tls: ServerTls | None = None
    #: how the endpoint reaches the name servers (the broker's peer_security())
    peer_security: ClientSecurity | None = None
    #: access control (the broker's guard; None: off): every RPC is signed and checked
    guard: Guard | None = None
