"""Operator queries: topics, consumer-group configs, queue statistics, message lookups,
group offsets, the DLQ, undecided transactions — of one broker, or of a whole cluster —
and the replicated broker sets: each broker's role, epoch and lag
(:meth:`~AdminClient.cluster`), the controller's view, a planned switchover of a set's
master (:meth:`~AdminClient.switchover`).

An :class:`AdminClient` given a broker's address asks that broker alone.  Given name
servers (``namesrv="h1:9876;h2:9876"``) it asks every master the name servers know
(``GetClusterInfo``) and merges the answers; rows name the broker set they come from
(``broker_name``; empty from a broker asked directly).  Both are one code path
(:mod:`txmq.admin.fanout`).

In a cluster, a broker that does not answer is logged and left out of a listing (its rows
are missing, the others are shown); when none answers, the error is raised.  A change
(:meth:`~AdminClient.create_topic`, :meth:`~AdminClient.update_group`,
:meth:`~AdminClient.dlq_resend`) that fails on one broker raises, saying where it was done
and where not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import msgspec

from txmq.admin import controller as controller_client
from txmq.admin.acl import AclAdmin
from txmq.admin.cluster import BrokerRow, ControllerView, cluster_rows
from txmq.admin.controller import SwitchoverResult
from txmq.admin.fanout import BrokerAddress, is_offset_id, merged
from txmq.admin.groups import GroupAdmin, GroupSummary, QueueProgress
from txmq.admin.transactions import BrokerDecisionRow, BrokerTransactionRow, TransactionAdmin
from txmq.protocol.codec import decode_record, decode_records
from txmq.protocol.message import MessageExt, Prop, is_system_topic
from txmq.protocol.peer import parse_namesrv
from txmq.protocol.wire import (
    DeleteSubscriptionGroup,
    DeleteTopic,
    DlqList,
    DlqResend,
    GetAllConsumerOffsets,
    GetAllSubscriptionGroups,
    GetAllTopicConfig,
    GetBrokerRuntimeInfo,
    GetTopicStats,
    GroupConfigRow,
    GroupOffset,
    QueryConsumerOffset,
    QueryMessageByKey,
    QueueReset,
    QueueStats,
    ReplicaInfo,
    ResetOffset,
    RuntimeInfo,
    TopicInfo,
    TopicRow,
    UpdateAndCreateTopic,
    UpdateSubscriptionGroup,
    ViewMessageById,
)
from txmq.protocol.wire.errors import GroupNotFound, MessageNotFound, TopicNotFound, TxmqError

__all__ = [
    "AdminClient",
    "BrokerAddress",
    "BrokerDecisionRow",
    "BrokerRow",
    "BrokerTransactionRow",
    "ConsumeTimeout",
    "ControllerView",
    "GroupSummary",
    "QueueProgress",
    "QueueReset",
    "SwitchoverResult",
    "epoch_ms",
    "wait_consumed",
]


class ConsumeTimeout(TxmqError, TimeoutError):
    """:meth:`AdminClient.wait_consumed` gave up: the group had not consumed the message
    (or the message was not found) before the time-out."""

    retriable = True


class AdminClient(TransactionAdmin, AclAdmin, GroupAdmin):
    """Operator queries of the broker given by ``address``, or of every broker of a
    cluster through its name servers (``namesrv=``).  Methods that take ``broker``
    (a broker set's name) ask only that broker set of the cluster."""

    # -- topics -----------------------------------------------------------------------------

    async def topics(self) -> list[TopicRow]:
        """Every topic of every broker, one row each.  In a cluster ``queue_nums``,
        ``messages`` and ``max_offset_total`` are summed over the broker sets holding the
        topic, and ``brokers`` gives each one's queue count."""
        answers = await self._each(await self.brokers(), lambda t: self.ask(t, GetAllTopicConfig()))
        merged: dict[str, TopicRow] = {}
        for target, answer in answers:
            for row in answer.topics:
                if target.broker_name:
                    row = msgspec.structs.replace(row, brokers={target.broker_name: row.queue_nums})
                seen = merged.get(row.topic)
                if seen is not None:
                    row = msgspec.structs.replace(
                        seen,
                        queue_nums=seen.queue_nums + row.queue_nums,
                        system=seen.system or row.system,
                        messages=seen.messages + row.messages,
                        max_offset_total=seen.max_offset_total + row.max_offset_total,
                        brokers={**seen.brokers, **row.brokers},
                    )
                merged[row.topic] = row
        return list(merged.values())

    async def topic_stats(self, topic: str) -> list[QueueStats]:
        """Each queue's offsets, over every broker set of the topic's route (ordered by
        broker name, then queue id)."""
        answers = await self._each(
            await self._topic_brokers(topic),
            lambda t: self.ask(t, GetTopicStats(topic=topic)),
            nothing=(TopicNotFound,),
        )
        return [
            msgspec.structs.replace(q, broker_name=t.broker_name) if t.broker_name else q
            for t, answer in answers
            for q in answer.queues
        ]

    async def create_topic(
        self,
        topic: str,
        queue_nums: int | None = None,
        *,
        cluster: str | None = None,
        broker: str | None = None,
    ) -> TopicInfo:
        """Create ``topic`` (or change its queue count) with ``queue_nums`` queues on each
        broker set (None: each broker's default).  Through name servers: on every master
        of ``cluster``, or on the broker set ``broker``; with neither, on every master of
        the only cluster there is.  ``queue_nums`` of the answer is the sum over the broker
        sets, ``brokers`` each one's count.  Raises if any broker refused (saying which
        did it)."""
        if self.direct is None and cluster is None and broker is None:
            clusters = sorted((await self.cluster_info()).clusters)
            if len(clusters) != 1:
                raise ValueError(
                    f"which cluster? the name servers know {', '.join(clusters) or 'none'}: "
                    "name a cluster or a broker set"
                )
            cluster = clusters[0]
        targets = await self.brokers(cluster=cluster, broker=broker)
        request = UpdateAndCreateTopic(topic=topic, queue_nums=queue_nums)
        results = await self._all_or_raise(targets, lambda t: self.ask(t, request), "created")
        if len(results) == 1 and not targets[0].broker_name:
            return results[0][1]
        counts = {t.broker_name: info.queue_nums for t, info in results}
        return TopicInfo(topic=topic, queue_nums=sum(counts.values()), brokers=counts)

    async def delete_topic(self, topic: str, *, broker: str | None = None) -> None:
        """Delete ``topic`` from every broker holding it (or from the broker set
        ``broker``)."""
        targets = await self.brokers(broker=broker) if broker else await self._topic_brokers(topic)
        request = DeleteTopic(topic=topic)
        await self._all_or_raise(targets, lambda t: self.ask(t, request), "deleted")

    # -- consumer-group configs -------------------------------------------------------------

    async def update_group(
        self,
        group: str,
        *,
        fifo: bool | None = None,
        retry_max_times: int | None = None,
        broker: str | None = None,
    ) -> list[GroupConfigRow]:
        """Create consumer group ``group``'s config or change what is given (``fifo``: the
        broker delivers a queue's messages one batch at a time, in order;
        ``retry_max_times``: 0 to 64, default 16) on every master (or on the broker set
        ``broker``).  The configs after the change, as :meth:`groups` lists them (one row
        unless the broker sets had different configs before).  Raises if any broker
        refused (saying where it was done)."""
        request = UpdateSubscriptionGroup(group=group, fifo=fifo, retry_max_times=retry_max_times)
        results = await self._all_or_raise(
            await self.brokers(broker=broker), lambda t: self.ask(t, request), "updated"
        )
        return _merged_groups((t.broker_name, [row]) for t, row in results)

    async def groups(self, *, broker: str | None = None) -> list[GroupConfigRow]:
        """Every configured consumer group (one nobody configured has the defaults), by
        name.  In a cluster a row lists the broker sets that have its config in
        ``brokers``; broker sets with different configs for a group give a row each."""
        answers = await self._each(
            await self.brokers(broker=broker), lambda t: self.ask(t, GetAllSubscriptionGroups())
        )
        return _merged_groups((t.broker_name, answer.groups) for t, answer in answers)

    async def delete_group(self, group: str, *, broker: str | None = None) -> bool:
        """Forget consumer group ``group``'s config on every master (or on the broker set
        ``broker``): it has the defaults again.  False if no broker had one."""
        request = DeleteSubscriptionGroup(group=group)
        results = await self._all_or_raise(
            await self.brokers(broker=broker), lambda t: self.ask(t, request), "deleted"
        )
        return any(answer.deleted for _, answer in results)

    # -- messages ---------------------------------------------------------------------------

    async def message_by_id(self, msg_id: str, *, broker: str | None = None) -> MessageExt:
        """The message with this id (or offset message id), from whichever broker has it.
        An offset message id is a commit-log offset: in a cluster, several brokers may
        have a message there — name the broker set then (``broker``)."""

        async def view(target: BrokerAddress) -> MessageExt:
            answer = await self.ask_with_body(target, ViewMessageById(msg_id=msg_id))
            msg = decode_record(answer.body, verify=True)
            msg.broker_name = target.broker_name
            return msg

        found = await self._each(
            await self.brokers(broker=broker), view, nothing=(MessageNotFound,)
        )
        if len(found) > 1 and is_offset_id(msg_id):
            where = ", ".join(m.broker_name for _, m in found)
            raise ValueError(
                f"offset message id {msg_id} is a message on each of {where}: name the broker"
            )
        return found[0][1]

    async def messages_by_key(
        self, key: str, max_num: int = 32, *, broker: str | None = None
    ) -> list[MessageExt]:
        """Up to ``max_num`` messages with key ``key``, over every broker (merged by store
        time)."""

        async def query(target: BrokerAddress) -> list[MessageExt]:
            answer = await self.ask_with_body(target, QueryMessageByKey(key=key, max_num=max_num))
            msgs = decode_records(answer.body)
            for m in msgs:
                m.broker_name = target.broker_name
            return msgs

        found = await self._each(
            await self.brokers(broker=broker), query, nothing=(MessageNotFound,)
        )
        return merged([msgs for _, msgs in found], lambda m: m.store_timestamp, max_num)

    async def wait_consumed(
        self,
        msg_id_or_key: str,
        group: str,
        *,
        timeout: float = 10.0,
        poll_interval: float = 0.05,
    ) -> MessageExt:
        """Wait until consumer group ``group`` has consumed the message with this id (a
        :class:`SendResult`'s ``msg_id``) or, if none has that id, the newest message
        with this key: until the group's committed offset of the message's queue is past
        the message.  Returns the message; raises :class:`ConsumeTimeout` after
        ``timeout`` seconds (also when no such message is stored by then: a transactional
        message is found once it is committed).

        A consumer commits its offsets every few seconds (a push consumer's
        ``persist_interval``, 5 s by default): that is how late this may answer."""
        found: MessageExt | None = None
        with anyio.move_on_after(timeout):
            while found is None:
                found = await self._consumable(msg_id_or_key)
                if found is None:
                    await anyio.sleep(poll_interval)
            target = (await self.brokers(broker=found.broker_name or None))[0]
            request = QueryConsumerOffset(group=group, topic=found.topic, queue_id=found.queue_id)
            while True:
                if (await self.ask(target, request)).offset > found.queue_offset:
                    return found
                await anyio.sleep(poll_interval)
        if found is None:
            raise ConsumeTimeout(
                f"no message {msg_id_or_key!r} (by id or key) was found within {timeout:g} s, "
                f"so group {group!r} cannot have consumed it"
            )
        raise ConsumeTimeout(
            f"group {group!r} has not consumed message {found.msg_id} ({found.topic}, queue "
            f"{found.queue_id} offset {found.queue_offset}"
            f"{', broker ' + found.broker_name if found.broker_name else ''}) "
            f"within {timeout:g} s"
        )

    async def _consumable(self, msg_id_or_key: str) -> MessageExt | None:
        """The stored message a consumer group consumes (not a half message, nor a retry or
        DLQ copy) with this id or else this key; None: none (yet)."""
        try:
            msg: MessageExt | None = await self.message_by_id(msg_id_or_key)
        except (MessageNotFound, ValueError):
            msg = None
        if msg is not None and not is_system_topic(msg.topic):
            return msg
        # a half message or a retry copy is newer: the original is found by its key
        key = msg.keys[0] if msg is not None and msg.keys else msg_id_or_key
        try:
            by_key = await self.messages_by_key(key, 64)
        except MessageNotFound:
            return None
        candidates = [
            m
            for m in by_key
            if not is_system_topic(m.topic)
            and (msg is None or m.all_properties.get(Prop.UNIQ_KEY) == msg.msg_id)
        ]
        return max(candidates, key=lambda m: m.store_timestamp, default=None)

    # -- offsets and the brokers ------------------------------------------------------------

    async def offsets(self) -> list[GroupOffset]:
        """Every consumer group's committed offset and lag, per queue, over every broker
        (ordered by group, topic, broker name and queue id)."""
        answers = await self._each(
            await self.brokers(), lambda t: self.ask(t, GetAllConsumerOffsets())
        )
        rows = [
            msgspec.structs.replace(o, broker_name=t.broker_name) if t.broker_name else o
            for t, answer in answers
            for o in answer.offsets
        ]
        return sorted(rows, key=lambda o: (o.group, o.topic, o.broker_name, o.queue_id))

    async def reset_offsets(
        self,
        group: str,
        topic: str,
        to: datetime | int,
        *,
        broker: str | None = None,
        force: bool = True,
    ) -> list[QueueReset]:
        """Move consumer group ``group``'s offset of every queue of ``topic`` to the first
        message stored at or after ``to`` (a datetime, naive meaning UTC, or ms since the
        epoch): RocketMQ's ``resetOffsetByTime``.  A time before every message it still
        holds: the oldest; a time after the newest: the end (nothing left to consume).
        ``force=False`` only moves offsets back.  Every broker set holding the topic (or
        only ``broker``) writes the new offsets and tells the group's connected push
        consumers, which drop what they pulled and consume from there.  Returns each
        queue's offset before (-1: none committed) and after, ordered by broker name and
        queue id.  Raises :class:`TopicNotFound` / :class:`GroupNotFound` when no broker
        set has the topic / knows the group, and says where it was done if one failed."""
        request = ResetOffset(group=group, topic=topic, timestamp_ms=epoch_ms(to), force=force)

        async def reset(target: BrokerAddress) -> list[QueueReset] | GroupNotFound:
            try:
                answer = await self.ask(target, request)
            except GroupNotFound as exc:  # a broker set where the group never was
                return exc
            if not target.broker_name:
                return answer.queues
            return [
                msgspec.structs.replace(q, broker_name=target.broker_name) for q in answer.queues
            ]

        targets = await self.brokers(broker=broker) if broker else await self._topic_brokers(topic)
        results = await self._all_or_raise(targets, reset, "reset")
        rows = [q for _, found in results if not isinstance(found, GroupNotFound) for q in found]
        if not rows:
            unknown = [found for _, found in results if isinstance(found, GroupNotFound)]
            if len(unknown) == 1:
                raise unknown[0]
            raise GroupNotFound(f"no broker set holding {topic!r} knows consumer group {group!r}")
        return sorted(rows, key=lambda q: (q.broker_name, q.queue_id))

    async def runtime_info(self, *, broker: str | None = None) -> RuntimeInfo:
        """One broker's runtime information: the broker given directly, or the master of
        the broker set ``broker`` (needed when the cluster has more than one)."""
        targets = await self.brokers(broker=broker)
        if len(targets) > 1:
            names = ", ".join(t.broker_name for t in targets)
            raise ValueError(f"which broker? ({names}); runtime_infos() answers for each")
        return await self._runtime_info(targets[0])

    async def runtime_infos(self) -> list[RuntimeInfo]:
        """The runtime information of every broker of this client (each naming its
        cluster and broker set)."""
        return [info for _, info in await self._each(await self.brokers(), self._runtime_info)]

    async def _runtime_info(self, target: BrokerAddress) -> RuntimeInfo:
        info = await self.ask(target, GetBrokerRuntimeInfo())
        if not target.broker_name:
            return info
        # (its broker_id stays its own: under a controller the master registers as 0)
        return msgspec.structs.replace(info, cluster=target.cluster, broker_name=target.broker_name)

    async def cluster(self, *, controller: str | Sequence[str] | None = None) -> list[BrokerRow]:
        """Every broker of the cluster — masters and slaves, by cluster and broker name —
        with its address, role, version, uptime, topics, connections, commit-log max
        offset, stored messages and consumer lag, and its part in its broker set (role,
        epoch, a slave's lag, the set's in-sync slaves, the controller's view).  A broker
        that does not answer has a row with ``error`` set.  A broker given directly:
        itself.  ``controller``: the controllers to ask ("h1:p1;h2:p2"; None: a name
        server hosting one, else those the brokers heartbeat to)."""
        return await cluster_rows(self, _addresses(controller))

    # -- replication --------------------------------------------------------------------

    async def controllers(self, *, broker: str | None = None) -> list[str]:
        """Where a controller may be: the name servers (one may host it), then the
        controllers the brokers heartbeat to (those of the broker set ``broker``)."""
        found: list[str] = list(self.namesrv)
        if self.direct is not None:
            broker = None  # the broker given
        try:
            infos = [await self._runtime_info(t) for t in await self.brokers(broker=broker)]
        except (TxmqError, ValueError):
            return found  # (the name servers' answer, or a set that has no master now)
        found += [c for info in infos for c in info.controllers]
        return list(dict.fromkeys(found))

    async def replica_info(self, *, controller: str | Sequence[str] | None = None) -> ReplicaInfo:
        """The controller's view of every broker set: epoch, master, in-sync slaves, each
        replica's state, and whether an election runs."""
        addresses = _addresses(controller) or await self.controllers()
        answer = await controller_client.replica_info(
            addresses, timeout=self.request_timeout, security=self.security
        )
        return answer[1]

    async def switchover(
        self,
        broker: str,
        to: int = -1,
        *,
        controller: str | Sequence[str] | None = None,
        timeout_s: float = 10.0,
        force: bool = False,
    ) -> SwitchoverResult:
        """A planned change of broker set ``broker``'s master to the broker whose own id
        is ``to`` (-1: the best in-sync slave), once it has everything the master wrote;
        ``force``: end a failover that waits for silent in-sync slaves (see
        :func:`txmq.admin.controller.switchover`)."""
        addresses = _addresses(controller) or await self.controllers(broker=broker)
        return await controller_client.switchover(
            addresses, broker, to, timeout_s=timeout_s, security=self.security, force=force
        )

    # -- the dead-letter queue ----------------------------------------------------------------

    async def dlq_list(
        self, group: str, offset: int = 0, max: int = 32, *, broker: str | None = None
    ) -> list[MessageExt]:
        """Up to ``max`` dead letters of consumer group ``group`` from queue offset ``offset``.

        Each message's topic is ``%DLQ%<group>``; its RETRY_TOPIC property names the topic
        it was first sent to, its ``dlq_reason`` why it is there (its listener's
        ``DeadLetter`` reason, or its retries used up).  An empty list if the group has no
        dead letters.  In a
        cluster each broker set has a DLQ of its own: ``offset`` and ``max`` apply to each
        (page one with ``broker``), and each message names its ``broker_name``.
        """

        async def page(target: BrokerAddress) -> list[MessageExt]:
            answer = await self.ask_with_body(target, DlqList(group=group, offset=offset, max=max))
            msgs = decode_records(answer.body) if answer.body else []
            for m in msgs:
                m.broker_name = target.broker_name
            return msgs

        found = await self._each(await self.brokers(broker=broker), page)
        return [m for _, msgs in found for m in msgs]

    async def dlq_resend(
        self, group: str, msg_ids: list[str] | None = None, *, broker: str | None = None
    ) -> int:
        """Store dead letters again in ``%RETRY%<group>`` (no delay, reconsume times 0).

        ``msg_ids=None`` re-sends every dead letter of the group.  The DLQ keeps its copy:
        re-sending a message twice delivers it twice.  Returns how many were re-sent.  In a
        cluster every broker set re-sends the ones it holds; offset message ids (a
        commit-log offset, one broker's) need ``broker``.
        """
        if msg_ids is not None and not msg_ids:
            return 0
        if msg_ids is None:
            request = DlqResend(group=group, all=True)
        else:
            request = DlqResend(group=group, msg_ids=list(msg_ids))
        targets = await self.brokers(broker=broker)
        if len(targets) > 1 and msg_ids and any(is_offset_id(i) for i in msg_ids):
            raise ValueError(
                "offset message ids name a message on one broker: name the broker set, or "
                "give the messages' unique ids (msg_id)"
            )
        results = await self._all_or_raise(targets, lambda t: self.ask(t, request), "re-sent")
        return sum(answer.resent for _, answer in results)


def _merged_groups(
    answers: Iterable[tuple[str, list[GroupConfigRow]]],
) -> list[GroupConfigRow]:
    """Rows of the same group and config from several broker sets as one, naming them
    (``brokers``; none from a broker asked directly), ordered by group."""
    merged: dict[tuple[str, bool, int], list[str]] = {}
    for broker_name, rows in answers:
        for row in rows:
            names = merged.setdefault((row.group, row.fifo, row.retry_max_times), [])
            if broker_name:
                names.append(broker_name)
    return [
        GroupConfigRow(group=g, fifo=f, retry_max_times=r, brokers=sorted(names))
        for (g, f, r), names in sorted(merged.items())
    ]


def _addresses(given: str | Sequence[str] | None) -> list[str]:
    """Controller addresses given as "h1:p1;h2:p2" or a list (checked; empty: none)."""
    if not given:
        return []
    text = given if isinstance(given, str) else ";".join(given)
    return list(parse_namesrv(text, setting="--controller"))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_ms(t: datetime | int) -> int:
    """A time as ms since the epoch: a datetime (naive: UTC), or ms as they are."""
    if isinstance(t, datetime):
        aware = t if t.tzinfo else t.replace(tzinfo=UTC)
        return (aware - _EPOCH) // timedelta(milliseconds=1)
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(f"a time must be a datetime or ms since the epoch (>= 0), not {t!r}")
    return t


async def wait_consumed(
    msg_id_or_key: str,
    group: str,
    address: str | None = None,
    *,
    timeout: float = 10.0,
    poll_interval: float = 0.05,
    **client: Any,
) -> MessageExt:
    """:meth:`AdminClient.wait_consumed` with a client of its own: ``address`` (a broker)
    or ``namesrv=`` (a cluster's name servers) and the client's other keyword arguments."""
    async with AdminClient(address, **client) as admin:
        return await admin.wait_consumed(
            msg_id_or_key, group, timeout=timeout, poll_interval=poll_interval
        )
