"""The consumer groups the brokers know, a part of :class:`txmq.admin.client.AdminClient`:
every group with live members or committed offsets (members, total lag, whether it has a
config), a group's members (RocketMQ mqadmin's ``consumerConnection``) and its progress per
queue (``consumerProgress``)."""

from __future__ import annotations

import msgspec

from txmq.admin.fanout import ClusterClient
from txmq.protocol.wire import (
    ConsumerConnection,
    GetAllConsumerOffsets,
    GetAllSubscriptionGroups,
    GetConsumerConnectionList,
    GroupConfigRow,
    GroupOffset,
)

__all__ = ["GroupAdmin", "GroupSummary"]

#: a group nobody configured: not FIFO, 16 retries
DEFAULT_RETRY_MAX = 16


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
        answers = await self._each(
            await self.brokers(broker=broker), lambda t: self.ask(t, GetAllConsumerOffsets())
        )
        rows = [
            msgspec.structs.replace(o, broker_name=t.broker_name) if t.broker_name else o
            for t, answer in answers
            for o in answer.offsets
            if group is None or o.group == group
        ]
        return sorted(rows, key=lambda o: (o.group, o.topic, o.broker_name, o.queue_id))

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
