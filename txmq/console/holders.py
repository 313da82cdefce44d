"""Which member of a consumer group holds which queue.

The brokers do not record it: each member computes its share itself, with
:func:`txmq.consumer.allocate.allocate_averagely` (the push consumer's default, RocketMQ's
AllocateMessageQueueAveragely) over the topic's queues sorted and the group's members
sorted, as a broker of the topic lists them.  The console runs the same function on the
same lists, so it shows the allocation the members compute.  It learns a group's topics
from its committed offsets (the brokers keep no subscriptions it could ask for).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from txmq.admin.client import AdminClient
from txmq.consumer.allocate import MessageQueue, allocate_averagely
from txmq.protocol.wire import GroupOffset
from txmq.protocol.wire.errors import TopicNotFound

__all__ = ["Holding", "queue_holders"]


@dataclass(frozen=True)
class Holding:
    topic: str
    broker_name: str
    queue_id: int
    #: the member the allocation gives the queue to ("" when the group has no member)
    holder: str


def members_for(mqs: Sequence[MessageQueue], members: Mapping[str, Sequence[str]]) -> list[str]:
    """The members as a consumer of these queues sees them: the list of the first broker set
    of the topic (by name) that has one; a broker asked directly is named ""."""
    for broker in sorted({mq.broker_name for mq in mqs}):
        if broker in members:
            return sorted(members[broker])
    if "" in members:
        return sorted(members[""])
    return sorted({m for ids in members.values() for m in ids})


def allocation(
    group: str, mqs: Sequence[MessageQueue], client_ids: Sequence[str]
) -> dict[MessageQueue, str]:
    """Each queue's member, as the members compute it (queues and members sorted)."""
    queues, ids = sorted(mqs), sorted(client_ids)
    return {mq: cid for cid in ids for mq in allocate_averagely(group, cid, queues, ids)}


async def queue_holders(
    client: AdminClient,
    group: str,
    offsets: Sequence[GroupOffset],
    members: Mapping[str, Sequence[str]],
) -> list[Holding]:
    """The queues of the topics ``group`` has committed offsets on, each with the member
    that the allocation gives it to."""
    out: list[Holding] = []
    for topic in sorted({o.topic for o in offsets if o.group == group}):
        try:
            stats = await client.topic_stats(topic)
        except TopicNotFound:
            continue
        mqs = sorted(MessageQueue(topic, q.broker_name, q.queue_id) for q in stats)
        held = allocation(group, mqs, members_for(mqs, members))
        out += [Holding(mq.topic, mq.broker_name, mq.queue_id, held.get(mq, "")) for mq in mqs]
    return out
