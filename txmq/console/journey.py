"""A message's journey, from what the brokers keep: every record of it (they share its
message id, the UNIQ_KEY property, and its keys), each classified — stored in its topic,
prepared as a half message, parked, waiting for a retry, retried for a consumer group
(``%RETRY%<group>``, with its reconsume times), dead-lettered (``%DLQ%<group>``) — and, per
consumer group with a committed offset on a record's queue, whether the group consumed it
(its committed offset is past the record's queue offset) or not yet.

The copies are found with the admin client's lookups: by id (the newest record with that
id) and by key (every record with the key, whatever its topic: a copy keeps the original's
keys).  A message without keys shows the record its id finds only.  At most
:data:`COPIES_MAX` records are read per lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from txmq.admin.client import AdminClient
from txmq.protocol.message import (
    HALF_TOPIC,
    PARKED_TOPIC,
    SCHEDULE_TOPIC,
    MessageExt,
    Prop,
    is_system_topic,
)
from txmq.protocol.wire import GroupOffset
from txmq.protocol.wire.errors import MessageNotFound

__all__ = ["COPIES_MAX", "Consumed", "Journey", "Record", "journeys"]

#: records of a message (and messages of a key) read at most
COPIES_MAX = 50
DLQ_PREFIX, RETRY_PREFIX = "%DLQ%", "%RETRY%"
Kind = Literal["stored", "half", "parked", "scheduled", "retry", "dead", "other"]


@dataclass(frozen=True)
class Consumed:
    """A consumer group's committed offset on a record's queue."""

    group: str
    consumed: bool
    #: the committed offset
    at: int


@dataclass(frozen=True)
class Record:
    """One record of the message."""

    msg: MessageExt
    kind: Kind
    #: the consumer group of a retry, scheduled retry or dead-letter copy ("" otherwise)
    group: str = ""
    #: the groups with a committed offset on its queue (stored and retry records)
    consumers: list[Consumed] = field(default_factory=list)


@dataclass(frozen=True)
class Journey:
    #: the record the page shows first: the message in its topic when it is found
    main: MessageExt
    #: every record found, oldest first (``main`` among them)
    records: list[Record]
    #: the groups with a committed offset on ``main``'s queue
    groups: list[Consumed]
    #: False when its copies could not be looked for (it has no keys)
    searched: bool
    #: True when a lookup returned :data:`COPIES_MAX` records (there may be more)
    cut: bool

    @property
    def retries(self) -> list[Record]:
        return [r for r in self.records if r.kind == "retry"]

    @property
    def dead(self) -> list[Record]:
        return [r for r in self.records if r.kind == "dead"]


def _kind(msg: MessageExt) -> tuple[Kind, str]:
    topic = msg.topic
    if topic.startswith(RETRY_PREFIX):
        return "retry", topic.removeprefix(RETRY_PREFIX)
    if topic.startswith(DLQ_PREFIX):
        return "dead", topic.removeprefix(DLQ_PREFIX)
    if topic == HALF_TOPIC:
        return "half", ""
    if topic == PARKED_TOPIC:
        return "parked", ""
    if topic == SCHEDULE_TOPIC:
        real = msg.all_properties.get(Prop.REAL_TOPIC, "")
        return "scheduled", real.removeprefix(RETRY_PREFIX) if real.startswith(RETRY_PREFIX) else ""
    if is_system_topic(topic):
        return "other", ""
    return "stored", ""


def _consumers(msg: MessageExt, offsets: Sequence[GroupOffset]) -> list[Consumed]:
    """The groups with a committed offset on ``msg``'s queue: consumed when past it."""
    return [
        Consumed(o.group, o.offset > msg.queue_offset, o.offset)
        for o in offsets
        if (o.topic, o.queue_id) == (msg.topic, msg.queue_id)
        and (o.broker_name or "") == (msg.broker_name or "")
    ]


def _same(a: MessageExt, b: MessageExt) -> bool:
    return (a.broker_name, a.commit_log_offset) == (b.broker_name, b.commit_log_offset)


def journey_of(
    msgs: Sequence[MessageExt],
    offsets: Sequence[GroupOffset],
    *,
    searched: bool = True,
    cut: bool = False,
) -> Journey:
    """The journey of one message from its records ``msgs`` (one message id)."""
    unique: list[MessageExt] = []
    for m in msgs:
        if not any(_same(m, seen) for seen in unique):
            unique.append(m)
    unique.sort(key=lambda m: (m.store_timestamp, m.broker_name or "", m.commit_log_offset))
    records = []
    for m in unique:
        kind, group = _kind(m)
        consumers = _consumers(m, offsets) if kind in ("stored", "retry") else []
        records.append(Record(m, kind, group, consumers))
    # a scheduled retry that was delivered has its %RETRY% copy: show that one only
    delivered = {(r.group, r.msg.reconsume_times) for r in records if r.kind == "retry"}
    records = [
        r
        for r in records
        if not (r.kind == "scheduled" and (r.group, r.msg.reconsume_times) in delivered)
    ]
    stored = [r for r in records if r.kind == "stored"]
    main = (stored or records)[0]
    return Journey(
        main=main.msg,
        records=records,
        groups=main.consumers if main.kind == "stored" else _consumers(main.msg, offsets),
        searched=searched,
        cut=cut,
    )


async def _by_key(client: AdminClient, key: str, broker: str | None) -> list[MessageExt]:
    try:
        return await client.messages_by_key(key, COPIES_MAX, broker=broker)
    except MessageNotFound:
        return []


async def journeys(
    client: AdminClient, *, msg_id: str = "", key: str = "", broker: str | None = None
) -> list[Journey]:
    """The journey of the message with id ``msg_id``, or of each message with key ``key``
    (newest first); :class:`MessageNotFound` when there is none."""
    offsets = await client.offsets()
    if msg_id:
        first = await client.message_by_id(msg_id, broker=broker)
        if not first.keys:
            return [journey_of([first], offsets, searched=False)]
        found = await _by_key(client, first.keys[0], broker)
        copies = [m for m in found if m.msg_id == first.msg_id]
        return [journey_of([first, *copies], offsets, cut=len(found) >= COPIES_MAX)]
    found = await _by_key(client, key, broker)
    if not found:
        raise MessageNotFound(f"no message has the key {key!r}")
    by_id: dict[str, list[MessageExt]] = {}
    for m in found:
        by_id.setdefault(m.msg_id, []).append(m)
    cut = len(found) >= COPIES_MAX
    out = [journey_of(msgs, offsets, cut=cut) for msgs in by_id.values()]
    out.sort(key=lambda j: j.main.store_timestamp, reverse=True)
    return out
