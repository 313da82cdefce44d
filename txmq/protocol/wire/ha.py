"""Replication between the brokers of one broker set (the master's HA port).

A slave says hello with its commit log's end and its epoch history; the master answers with
where the slave must cut its log back to (a tail the master never had), or where an empty
slave starts.  Then the slave asks for records again and again (:class:`HaTransfer`): each
request's ``offset`` is also the slave's acknowledgement of everything before it, and the
master holds a request that finds nothing new for up to ``wait_ms`` (long polling), so a
new record goes out as soon as it is written.  Every few seconds the slave also copies the
master's metadata (:class:`HaGetMetadata`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from txmq.protocol.wire.base import Name, Request, Response
from txmq.protocol.wire.codes import RequestCode

__all__ = [
    "EpochEntry",
    "HaBatch",
    "HaGetMetadata",
    "HaHandBackOffsets",
    "HaHello",
    "HaMetadata",
    "HaTransfer",
    "HaWelcome",
]

Offset = Annotated[int, msgspec.Meta(ge=0)]
BrokerId = Annotated[int, msgspec.Meta(ge=0, le=1024)]


class EpochEntry(msgspec.Struct, frozen=True, kw_only=True):
    """From ``start`` on, the commit log was written by the master of ``epoch``."""

    epoch: Annotated[int, msgspec.Meta(ge=0)]
    start: Offset


class HaWelcome(Response, frozen=True, kw_only=True, omit_defaults=True):
    """The master's answer to a hello: its epoch history; ``truncate_to`` (>= 0) where the
    slave cuts its commit log back first; ``start_at`` (>= 0) where an empty slave begins
    (the master's oldest segment)."""

    epoch: int
    epochs: list[EpochEntry]
    master_offset: int
    truncate_to: int = -1
    start_at: int = -1


class HaHello(Request[HaWelcome], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.HA_HELLO
    broker_name: Name
    broker_id: BrokerId
    #: where clients reach the slave (shown by ``txmq admin cluster``)
    address: str = ""
    offset: Offset
    epochs: list[EpochEntry] = []


class HaBatch(Response, frozen=True, kw_only=True, omit_defaults=True):
    """Records from ``offset`` (the frame's body, whole records; empty after a wait that
    found nothing), the master's commit-log end, and the master's current epoch."""

    offset: int
    master_offset: int
    epoch: int
    epoch_start: int
    #: grows when the master's topics change: the slave copies the metadata at once
    meta_version: int = 0


class HaTransfer(Request[HaBatch], frozen=True, kw_only=True, omit_defaults=True):
    """Records from ``offset``; the slave has everything before it."""

    CODE = RequestCode.HA_TRANSFER
    broker_id: BrokerId
    offset: Offset
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] = 1000


class HaMetadata(Response, frozen=True, kw_only=True, omit_defaults=True):
    """The master's topics, consumer offsets, delay-level offsets and transaction-check
    offsets, each in the JSON form of the broker's state file of the same name."""

    #: the master's commit-log end when it took these: a slave takes the offsets only once
    #: its own log reaches it (an offset never points past what the slave has)
    log_end: int = 0
    topics: bytes = b""
    offsets: bytes = b""
    delay_offsets: bytes = b""
    transaction_offsets: bytes = b""
    #: consumer-group configs (``groups.json``; empty from an older master: kept as they are)
    groups: bytes = b""


class HaGetMetadata(Request[HaMetadata], frozen=True, kw_only=True, omit_defaults=True):
    CODE = RequestCode.HA_GET_METADATA
    broker_id: BrokerId


class HaHandBackOffsets(Request[HaMetadata], frozen=True, kw_only=True, omit_defaults=True):
    """Consumer offsets a slave took while its master was away (consumers read from it):
    the master keeps each one that is further than its own.  The answer is the master's
    metadata (with them)."""

    CODE = RequestCode.HA_HAND_BACK_OFFSETS
    broker_id: BrokerId
    #: group -> topic -> queue id -> offset
    offsets: dict[str, dict[str, dict[int, Offset]]]
