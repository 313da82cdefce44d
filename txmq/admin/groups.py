"""The consumer groups the brokers know, a part of :class:`txmq.admin.client.AdminClient`:
every group with live members or committed offsets (members, total lag, whether it has a
config), a group's members (RocketMQ mqadmin's ``consumerConnection``) and its progress per
queue (``consumerProgress``, with the store time of the last message consumed)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import msgspec

from txmq.admin.fanout import BrokerAddress, ClusterClient
from txmq.protocol.codec import CorruptRecord, decode_records
from txmq.protocol.wire import (
    ConsumerConnection,
    GetAllConsumerOffsets,
    GetAllSubscriptionGroups,
    GetConsumerConnectionList,
    GroupConfigRow,
    GroupOffset,
    PullMessage,
)
from txmq.protocol.wire.errors import TopicNotFound, TxmqError

__all__ = ["GroupAdmin", "GroupSummary", "QueueProgress"]

log = logging.getLogger("txmq.admin")

#: a group nobody configured: not FIFO, 16 retries
DEFAULT_RETRY_MAX = 16
#: store times read at once (one pull of one message each)
READS_AT_ONCE = 16


class GroupSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A consumer group as the brokers know it."""

    group: str
    #: distinct client ids connected now (over every broker set)
    members: int
    #: the sum of the lag of every queue it has committed an offset of (None: none)
    lag: int | None
    #: the topics it subscribes to (members' subscriptions) or has offsets of
    topics: list[str]
    #: whether a broker has an explicit config for it (else it has the defaults)
    config: bool
    #: None when broker sets have different configs for it
    fifo: bool | None
    retry_max_times: int | None
    #: the broker sets that know it (filled by a client of name servers)
    brokers: list[str] = []


class QueueProgress(msgspec.Struct, frozen=True, kw_only=True):
    """A consumer group's progress on one queue (a row of mqadmin's consumerProgress)."""

    group: str
    topic: str
    queue_id: int
    #: the group's committed offset (the next message it consumes)
    offset: int
    #: the queue's end (the broker offset)
    max_offset: int
    lag: int
    #: the store time (ms since the epoch) of the last message consumed, the one at
    #: ``offset - 1`` (mqadmin's LastTime); None when the offset is 0 or that message is
    #: gone (deleted with its commit-log file) or could not be read
    last_consumed_timestamp: int | None = None
    #: the broker set holding the queue (filled by a client of name servers)
    broker_name: str = ""


class GroupAdmin(ClusterClient):
    """Consumer groups, for :class:`txmq.admin.client.AdminClient`."""

    async def consumer_connections(
        self, group: str = "", *, broker: str | None = None
    ) -> list[ConsumerConnection]:
        """The live members of ``group`` (empty: of every group) on every master (or on the
        broker set ``broker``): a member connected to several broker sets gives a row for
        each, naming it (``broker_name``; empty from a broker asked directly)."""
        request = GetConsumerConnectionList(group=group)
        answers = await self._each(
            await self.brokers(broker=broker), lambda t: self.ask(t, request)
        )
        rows = [
            msgspec.structs.replace(c, broker_name=t.broker_name) if t.broker_name else c
            for t, answer in answers
            for c in answer.connections
        ]
        return sorted(rows, key=lambda c: (c.group, c.client_id, c.broker_name))

    async def group_offsets(
        self, group: str | None = None, *, broker: str | None = None
    ) -> list[GroupOffset]:
        """Committed offsets and lag per queue (of ``group`` only, if given), over every
        master (or the broker set ``broker``), by group, topic, broker set and queue."""
        return await self._offsets(await self.brokers(broker=broker), group)

    async def _offsets(
        self, targets: Sequence[BrokerAddress], group: str | None
    ) -> list[GroupOffset]:
        answers = await self._each(targets, lambda t: self.ask(t, GetAllConsumerOffsets()))
        rows = [
            msgspec.structs.replace(o, broker_name=t.broker_name) if t.broker_name else o
            for t, answer in answers
            for o in answer.offsets
            if group is None or o.group == group
        ]
        return sorted(rows, key=lambda o: (o.group, o.topic, o.broker_name, o.queue_id))

    async def group_progress(self, group: str, *, broker: str | None = None) -> list[QueueProgress]:
        """Consumer group ``group``'s progress per queue it has committed an offset of
        (mqadmin's consumerProgress): the offsets and lag of :meth:`group_offsets`, and
        the store time of the last message consumed — read with one pull of one message
        per queue (no consumer group named: nothing is committed; the broker counts it
        among the messages it hands out, under an empty group).  A queue whose message
        cannot be read has no time; when a broker refuses (a user without ``sub`` on
        group "" and the topic, under access control) it is logged once."""
        targets = await self.brokers(broker=broker)
        by_name = {t.broker_name: t for t in targets}
        offsets = await self._offsets(targets, group)
        times: list[int | None] = [None] * len(offsets)
        failed: list[TxmqError | CorruptRecord] = []
        limiter = anyio.CapacityLimiter(READS_AT_ONCE)

        async def read(i: int, o: GroupOffset) -> None:
            target = by_name.get(o.broker_name)
            if o.offset <= 0 or target is None:
                return
            async with limiter:
                try:
                    times[i] = await self._store_time(target, o.topic, o.queue_id, o.offset - 1)
                except (TxmqError, CorruptRecord) as exc:
                    failed.append(exc)

        async with anyio.create_task_group() as tg:
            for i, o in enumerate(offsets):
                tg.start_soon(read, i, o)
        if failed:
            log.warning(
                "the last consumed message of %d queue(s) could not be read: %s",
                len(failed),
                failed[0],
            )
        return [
            QueueProgress(
                group=o.group,
                topic=o.topic,
                queue_id=o.queue_id,
                offset=o.offset,
                max_offset=o.max_offset,
                lag=o.lag,
                last_consumed_timestamp=t,
                broker_name=o.broker_name,
            )
            for o, t in zip(offsets, times, strict=True)
        ]

    async def _store_time(
        self, target: BrokerAddress, topic: str, queue_id: int, offset: int
    ) -> int | None:
        """The store time of the message at ``offset`` of a queue (None: not there, or no
        longer: its topic deleted, or its commit-log file)."""
        request = PullMessage(topic=topic, queue_id=queue_id, offset=offset, max_msgs=1)
        try:
            answer = await self.ask_with_body(target, request)
        except TopicNotFound:
            return None
        if answer.header.status != "FOUND" or not answer.body:
            return None
        found = [m for m in decode_records(answer.body) if m.queue_offset == offset]
        return found[0].store_timestamp if found else None

    async def group_summaries(self, *, broker: str | None = None) -> list[GroupSummary]:
        """Every consumer group the brokers know — with live members, committed offsets or
        a config — by name."""
        connections = await self.consumer_connections(broker=broker)
        offsets = await self.group_offsets(broker=broker)
        configs: dict[str, list[tuple[str, GroupConfigRow]]] = {}
        answers = await self._each(
            await self.brokers(broker=broker), lambda t: self.ask(t, GetAllSubscriptionGroups())
        )
        for t, answer in answers:
            for row in answer.groups:
                configs.setdefault(row.group, []).append((t.broker_name, row))
        names = sorted({c.group for c in connections} | {o.group for o in offsets} | set(configs))
        out = []
        for name in names:
            members = [c for c in connections if c.group == name]
            mine = [o for o in offsets if o.group == name]
            rows = configs.get(name, [])
            kinds = {(r.fifo, r.retry_max_times) for _, r in rows}
            fifo, retry = kinds.pop() if len(kinds) == 1 else (None, None)
            if not rows:
                fifo, retry = False, DEFAULT_RETRY_MAX
            topics = {t for c in members for t in c.subscriptions} | {o.topic for o in mine}
            brokers = (
                {c.broker_name for c in members}
                | {o.broker_name for o in mine}
                | {b for b, _ in rows}
            )
            out.append(
                GroupSummary(
                    group=name,
                    members=len({c.client_id for c in members}),
                    lag=sum(o.lag for o in mine) if mine else None,
                    topics=sorted(topics),
                    config=bool(rows),
                    fifo=fifo,
                    retry_max_times=retry,
                    brokers=sorted(b for b in brokers if b),
                )
            )
        return out
