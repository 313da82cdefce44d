"""The clients the gRPC endpoint knows: their Telemetry streams and what they said.

A RocketMQ 5 client opens one ``Telemetry`` stream per endpoint and sends its settings
first (its type, the topics it publishes or its group and subscriptions); the broker
answers with its own settings on the same stream.  A producer's stream is also how the
broker reaches it later: a half message nobody decided is sent there as a
``RecoverOrphanedTransactionCommand`` (check-back), and the client answers with an
``EndTransaction`` request.

A producer session registers in the endpoint's producer registry (the broker's
``ProducerManager``, or a proxy's) under one producer group per topic it publishes (the
name of the topic: RocketMQ 5 clients have no producer group, and the RocketMQ proxy names
transactional producer groups after their topic too), so the transaction checker treats it
like a txmq producer connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb

from txmq.protocol.codec import decode_record
from txmq.protocol.message import Prop
from txmq.protocol.wire import CheckTransactionState
from txmq.server.grpc.convert import message_of
from txmq.server.grpc.ports import ProducerRegistry

__all__ = ["Session", "Sessions", "parse_transaction_id", "transaction_id"]

log = logging.getLogger("txmq.grpc")

#: commands waiting to be written to one client's stream (a slow client loses none, but
#: is disconnected past this many)
MAX_PENDING_COMMANDS = 10_000
_HEX = "0123456789abcdefABCDEF"


def transaction_id(offset: int, broker: str = "") -> str:
    """The ``transaction_id`` a client gets for the half message at commit-log ``offset``
    (and gives back in EndTransaction): ``BROKER:OFFSET`` when it names its broker set
    (``broker``: one that is not the endpoint's own; broker names have no ``:``)."""
    return f"{broker}:{offset:016X}" if broker else f"{offset:016X}"


def parse_transaction_id(text: str) -> tuple[str, int]:
    """(broker set or "", commit-log offset) of a :func:`transaction_id`; ValueError if it
    is not one."""
    broker, _, hexed = text.rpartition(":")
    if not 0 < len(hexed) <= 16 or hexed.strip(_HEX):
        raise ValueError(f"{text!r} is not a transaction id")
    return broker, int(hexed, 16)


class Session:
    """One client's Telemetry stream: commands to write, and what it told the broker."""

    def __init__(self, client_id: str, peer: str, home: str = "") -> None:
        """``home``: the endpoint's own broker set (its transaction ids go unqualified)."""
        self.client_id = client_id
        self.home = home
        self.name = f"grpc:{client_id}@{peer}"
        self.client_type: int = pb.CLIENT_TYPE_UNSPECIFIED
        self.group = ""
        self.topics: list[str] = []
        self.settings: Any = None
        self.queue: asyncio.Queue[Any] = asyncio.Queue(MAX_PENDING_COMMANDS)
        self.closed = False
        #: like a connection's (``acl_user``: the user who opened the stream, under access
        #: control: a check-back goes only to producers of the half's sender)
        self.attributes: dict[str, Any] = {}

    def push(self, command: Any) -> bool:
        if self.closed:
            return False
        try:
            self.queue.put_nowait(command)
        except asyncio.QueueFull:
            log.warning("%s reads its telemetry stream too slowly: closing it", self.name)
            self.close()
            return False
        return True

    def close(self) -> None:
        """No more commands; the stream's writer ends at the end marker (commands not yet
        written are dropped: the client is gone or too slow)."""
        if self.closed:
            return
        self.closed = True
        while self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(None)

    # -- what the transaction checker calls (like txmq.protocol.connection.Connection) ----

    def send_oneway(self, request: Any, body: bytes = b"") -> None:
        """A check-back: the half message as a RecoverOrphanedTransactionCommand (its
        transaction id names the broker set that asks, unless it is the endpoint's own)."""
        if not isinstance(request, CheckTransactionState):
            return
        check, record = request, body
        broker = check.broker_name if check.broker_name != self.home else ""
        msg = decode_record(record)
        topic = msg.all_properties.get(Prop.REAL_TOPIC, check.topic)
        proto = message_of(msg, topic=pb.Resource(name=topic))
        proto.system_properties.message_type = pb.TRANSACTION
        proto.system_properties.queue_id = check.queue_id
        command = spb.TelemetryCommand(
            recover_orphaned_transaction_command=spb.RecoverOrphanedTransactionCommand(
                message=proto, transaction_id=transaction_id(check.transaction_offset, broker)
            )
        )
        self.push(command)


class Sessions:
    """client id -> its current session."""

    def __init__(self, producers: ProducerRegistry, home: str = "") -> None:
        self.producers = producers
        self.home = home
        self._by_client: dict[str, Session] = {}

    def open(self, client_id: str, peer: str) -> Session:
        old = self._by_client.get(client_id)
        if old is not None:
            self.close(old)
        session = self._by_client[client_id] = Session(client_id, peer, self.home)
        return session

    def get(self, client_id: str) -> Session | None:
        return self._by_client.get(client_id)

    def settled(self, session: Session) -> None:
        """The client sent its settings: a producer joins its topics' producer groups."""
        if session.client_type == pb.PRODUCER:
            self.heartbeat(session)

    def heartbeat(self, session: Session) -> None:
        if session.client_type == pb.PRODUCER and not session.closed:
            for topic in session.topics:
                self.producers.register(topic, session.client_id, session)

    def close(self, session: Session) -> None:
        session.close()
        if self._by_client.get(session.client_id) is session:
            del self._by_client[session.client_id]
        for topic in session.topics:
            self.producers.unregister(topic, session.client_id)

    def terminated(self, client_id: str) -> None:
        session = self._by_client.get(client_id)
        if session is not None:
            self.close(session)

    def all(self) -> list[Session]:
        return list(self._by_client.values())
