"""What a gRPC proxy (``txmq proxy start``) asks the broker sets over txmq's protocol:
RocketMQ 5's pop consumption (RocketMQ's POP_MESSAGE, ACK_MESSAGE and
CHANGE_MESSAGE_INVISIBLETIME, numbered txmq's way; dead-lettering a popped message and
reading a consumer group's config are txmq's own), and several sends of a topic in one
request (txmq's own: a proxy gathers its clients' sends, and acks, that come together).

A pop answers the records it hands out as the frame's body, one after the other, each
described by a :class:`PoppedEntry` (its receipt handle, attempt and size); several sends
carry their bodies so, each of :class:`SendEntry`'s ``size``."""

from __future__ import annotations

from typing import Annotated

import msgspec

from txmq.protocol.wire.admin import GroupConfigRow
from txmq.protocol.wire.base import Empty, Name, NameOrEmpty, Request, Response, Topic
from txmq.protocol.wire.codes import RequestCode
from txmq.protocol.wire.messaging import Sent

__all__ = [
    "AckMessage",
    "Acked",
    "ChangeInvisibleTime",
    "DeadLetterPopped",
    "Failure",
    "GetSubscriptionGroup",
    "PopMessage",
    "PopResult",
    "PoppedEntry",
    "SendEntry",
    "SendMessages",
    "SentMany",
]

#: a message's flag: a 32-bit unsigned field of the stored record
Flag = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]


class Failure(Response, frozen=True, kw_only=True, omit_defaults=True):
    """One entry of a request of several that failed: its index, the error's response
    code and message (the others succeeded)."""

    index: int
    code: int
    error: str = ""


class PoppedEntry(Response, frozen=True, kw_only=True, omit_defaults=True):
    """A message handed out: its receipt handle (the broker's), delivery attempt (from 1),
    when it becomes visible again (ms since the epoch) and the size of its record in the
    frame's body (0: no record, the answer to a change of its invisible time)."""

    handle: str
    attempt: int
    invisible_until_ms: int
    size: int = 0


class PopResult(Response, frozen=True, kw_only=True, omit_defaults=True):
    entries: list[PoppedEntry] = []


class PopMessage(Request[PopResult], frozen=True, kw_only=True, omit_defaults=True):
    """Up to ``max_msgs`` messages of ``topic`` (its queues on this broker, and
    ``%RETRY%<group>``), each invisible for ``invisible_ms``; with none at hand, the broker
    waits up to ``poll_ms`` for one (long polling).  ``fifo`` and ``max_attempts`` (the
    first delivery and the retries): None, as the group's config says."""

    CODE = RequestCode.POP_MESSAGE
    group: Name
    topic: Topic
    max_msgs: int = 32
    invisible_ms: int = 30_000
    poll_ms: int = 0
    #: the tag filter ("*", "tagA || tagB")
    expression: str = "*"
    fifo: bool | None = None
    max_attempts: int | None = None


class Acked(Response, frozen=True, kw_only=True, omit_defaults=True):
    """The handles that could not be acked (the others were)."""

    failed: list[Failure] = []


class AckMessage(Request[Acked], frozen=True, kw_only=True, omit_defaults=True):
    """The popped messages of receipts ``handles`` are consumed."""

    CODE = RequestCode.ACK_MESSAGE
    group: Name
    topic: Topic
    handles: list[str]


class ChangeInvisibleTime(Request[PoppedEntry], frozen=True, kw_only=True, omit_defaults=True):
    """The popped message of receipt ``handle`` is invisible for ``invisible_ms`` from now,
    under the new handle answered (the old one is void)."""

    CODE = RequestCode.CHANGE_MESSAGE_INVISIBLETIME
    group: Name
    topic: Topic
    handle: str
    invisible_ms: int


class DeadLetterPopped(Request[Empty], frozen=True, kw_only=True, omit_defaults=True):
    """Copy the popped message of receipt ``handle`` to ``%DLQ%<group>`` (with its
    consumer's ``reason``); it is done."""

    CODE = RequestCode.POP_DEAD_LETTER
    group: Name
    topic: Topic
    handle: str
    reason: str = ""


class GetSubscriptionGroup(Request[GroupConfigRow], frozen=True, kw_only=True, omit_defaults=True):
    """A consumer group's config (a group nobody configured: the defaults), as its
    consumers are told it."""

    CODE = RequestCode.GET_SUBSCRIPTIONGROUP_CONFIG
    group: Name


class SendEntry(Response, frozen=True, kw_only=True, omit_defaults=True):
    """One message of :class:`SendMessages`: a SendMessage's fields; its body is the next
    ``size`` bytes of the frame's body."""

    size: int
    queue_id: int
    properties: dict[str, str] = {}
    born_timestamp: Annotated[int, msgspec.Meta(ge=0)] = 0
    flag: Flag = 0
    group: NameOrEmpty = ""


class SentMany(Response, frozen=True, kw_only=True, omit_defaults=True):
    """Where each message was stored (None: it failed, said in ``failed``)."""

    sent: list[Sent | None]
    failed: list[Failure] = []


class SendMessages(Request[SentMany], frozen=True, kw_only=True, omit_defaults=True):
    """Store several messages of ``topic``, each as its own SendMessage would (in its own
    queue, a half message, a delayed one...); each answered on its own."""

    CODE = RequestCode.SEND_MESSAGES
    topic: Topic
    messages: list[SendEntry]
