"""Operators' requests: routes, topics, consumer-group configs, queue statistics, message
lookups, all group offsets, a group's offsets reset to a time, and the broker's runtime
information."""

from __future__ import annotations

import logging
from collections.abc import Callable

from txmq.broker.state.context import BrokerContext
from txmq.broker.state.subscriptions import GroupConfig
from txmq.broker.state.topics import check_queue_id
from txmq.protocol.codec import read_header, record_topic_and_props
from txmq.protocol.rpc import Call
from txmq.protocol.wire import (
    BrokerData,
    DeleteSubscriptionGroup,
    DeleteTopic,
    Empty,
    GetAllConsumerOffsets,
    GetAllSubscriptionGroups,
    GetAllTopicConfig,
    GetBrokerRuntimeInfo,
    GetTopicRoute,
    GetTopicStats,
    GroupConfigList,
    GroupConfigRow,
    GroupDeleted,
    GroupOffset,
    GroupOffsets,
    MessageCount,
    Offset,
    OffsetsReset,
    QueryMessageByKey,
    QueueData,
    QueueReset,
    QueueStats,
    ResetConsumerClientOffset,
    ResetOffset,
    RuntimeInfo,
    SearchOffset,
    TopicInfo,
    TopicList,
    TopicRoute,
    TopicRow,
    TopicStats,
    UpdateAndCreateTopic,
    UpdateSubscriptionGroup,
    ViewMessageById,
    WithBody,
)
from txmq.protocol.wire.errors import GroupNotFound, MessageNotFound, NotMaster, TopicNotFound
from txmq.security.acl.guard import peer_host
from txmq.security.acl.policy import Resource, topic_resource

__all__ = ["AdminService"]

log = logging.getLogger("txmq.broker")

MAX_QUERY_BY_KEY = 1000


class AdminService:
    def __init__(self, ctx: BrokerContext, runtime_info: Callable[[], RuntimeInfo]) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.topics = ctx.topics
        self._runtime_info = runtime_info

    # -- topics -----------------------------------------------------------------------------

    def route_info(self, req: GetTopicRoute, call: Call) -> TopicRoute:
        """The topic's route as this broker alone holds it (name servers answer for a
        cluster)."""
        if req.create and self.ctx.store.writable:  # (a slave creates no topics)
            cfg = self.topics.for_send(req.topic)
        else:
            found = self.topics.get(req.topic)
            if found is None:
                raise TopicNotFound(f"topic {req.topic!r} does not exist")
            cfg = found
        config = self.ctx.config
        return TopicRoute(
            topic=cfg.name,
            queues=[
                QueueData(
                    broker_name=config.broker_name,
                    read_queue_nums=cfg.queue_nums,
                    write_queue_nums=cfg.queue_nums,
                )
            ],
            brokers=[
                BrokerData(
                    cluster=config.cluster,
                    broker_name=config.broker_name,
                    addresses={config.broker_id: self._runtime_info().address},
                )
            ],
        )

    def create_topic(self, req: UpdateAndCreateTopic, call: Call) -> TopicInfo:
        queue_nums = req.queue_nums
        if queue_nums is None:
            queue_nums = self.ctx.config.default_queue_nums
        cfg = self.topics.create_or_update(req.topic, queue_nums)
        log.info("topic %s now has %d queues", cfg.name, cfg.queue_nums)
        return TopicInfo(topic=cfg.name, queue_nums=cfg.queue_nums)

    def delete_topic(self, req: DeleteTopic, call: Call) -> Empty:
        self.topics.check_name(req.topic)
        if not self.topics.delete(req.topic):
            raise TopicNotFound(f"topic {req.topic!r} does not exist")
        self.ctx.offsets.remove_topic(req.topic)
        return Empty()

    def all_topics(self, req: GetAllTopicConfig, call: Call) -> TopicList:
        stats = self.store.queue_offsets()
        rows = []
        for cfg in self.topics.all():
            queues = stats.get(cfg.name, {})
            rows.append(
                TopicRow(
                    topic=cfg.name,
                    queue_nums=cfg.queue_nums,
                    system=cfg.system,
                    messages=sum(mx - mn for mn, mx in queues.values()),
                    max_offset_total=sum(mx for _, mx in queues.values()),
                )
            )
        return TopicList(topics=rows)

    def topic_stats(self, req: GetTopicStats, call: Call) -> TopicStats:
        topic = req.topic
        cfg = self.topics.get(topic)
        if cfg is None:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        rows = []
        for queue_id in range(cfg.queue_nums):
            mn = self.store.min_offset(topic, queue_id)
            mx = self.store.max_offset(topic, queue_id)
            last = 0
            if mx > mn:
                got = self.store.get_messages(topic, queue_id, mx - 1, 1)
                if got.records:
                    last = read_header(got.records[0]).store_timestamp
            rows.append(
                QueueStats(queue_id=queue_id, min_offset=mn, max_offset=mx, last_store_ts=last)
            )
        return TopicStats(topic=topic, queues=rows)

    # -- consumer-group configs --------------------------------------------------------------

    def update_group(self, req: UpdateSubscriptionGroup, call: Call) -> GroupConfigRow:
        self._master_only(req.group)
        cfg = self.ctx.groups.update(req.group, fifo=req.fifo, retry_max_times=req.retry_max_times)
        log.info(
            "consumer group %s: fifo %s, retry_max_times %d",
            req.group,
            cfg.fifo,
            cfg.retry_max_times,
        )
        return _group_row(req.group, cfg)

    def all_groups(self, req: GetAllSubscriptionGroups, call: Call) -> GroupConfigList:
        return GroupConfigList(groups=[_group_row(g, c) for g, c in self.ctx.groups.all()])

    def delete_group(self, req: DeleteSubscriptionGroup, call: Call) -> GroupDeleted:
        self._master_only(req.group)
        deleted = self.ctx.groups.delete(req.group)
        if deleted:
            log.info("consumer group %s: config deleted", req.group)
        return GroupDeleted(deleted=deleted)

    def _master_only(self, group: str) -> None:
        """A slave copies its master's group configs: a change made on it would not last."""
        if not self.ctx.replica.is_master():
            raise NotMaster(
                f"this broker is a slave: change consumer group {group!r} on its broker "
                "set's master"
            )

    # -- messages ---------------------------------------------------------------------------

    def view_message(self, req: ViewMessageById, call: Call) -> WithBody[Empty]:
        msg_id = req.msg_id
        record = self.store.query_by_uniq_key(msg_id)
        if record is None and len(msg_id) == 16:
            try:
                record = self.store.look_message_by_offset(int(msg_id, 16))
            except ValueError:
                record = None
        if record is None:
            raise MessageNotFound(f"no message with id {msg_id!r}")
        denied = self._unreadable(call, record)
        if denied is not None:
            assert self.ctx.guard is not None
            self.ctx.guard.deny(call.user, "sub", denied, "ViewMessageById", call.conn)
        return WithBody(Empty(), record)

    def query_by_key(self, req: QueryMessageByKey, call: Call) -> WithBody[MessageCount]:
        max_num = min(req.max_num, MAX_QUERY_BY_KEY)
        records = self.store.query_by_key(req.key, max_num=max_num)
        if not records:
            raise MessageNotFound(f"no message with key {req.key!r}")
        denied = [res for r in records if (res := self._unreadable(call, r)) is not None]
        if denied:
            records = [r for r in records if self._unreadable(call, r) is None]
            if not records:
                assert self.ctx.guard is not None
                self.ctx.guard.deny(call.user, "sub", denied[0], "QueryMessageByKey", call.conn)
        return WithBody(MessageCount(count=len(records)), b"".join(records))

    def _unreadable(self, call: Call, record: bytes) -> Resource | None:
        """Under access control, the resource a message lookup's user may neither
        consume (``sub``) nor administer (None: readable; no access control)."""
        guard, user = self.ctx.guard, call.user
        if guard is None or user is None or user.super_user:
            return None
        res = topic_resource(record_topic_and_props(record)[0])
        source = peer_host(call.conn)
        if guard.allowed(user, res, "sub", source) or guard.allowed(user, res, "admin", source):
            return None
        return res

    # -- offsets and the broker -------------------------------------------------------------

    def all_offsets(self, req: GetAllConsumerOffsets, call: Call) -> GroupOffsets:
        rows = []
        for group, topics in sorted(self.ctx.offsets.snapshot().items()):
            for topic, queues in sorted(topics.items()):
                for queue_id, offset in sorted(queues.items()):
                    max_offset = self.store.max_offset(topic, queue_id)
                    rows.append(
                        GroupOffset(
                            group=group,
                            topic=topic,
                            queue_id=queue_id,
                            offset=offset,
                            max_offset=max_offset,
                            lag=max(max_offset - offset, 0),
                        )
                    )
        return GroupOffsets(offsets=rows)

    def search_offset(self, req: SearchOffset, call: Call) -> Offset:
        cfg = self.topics.get(req.topic)
        if cfg is None:
            raise TopicNotFound(f"topic {req.topic!r} does not exist")
        check_queue_id(cfg, req.queue_id)
        return Offset(offset=self.store.offset_by_time(req.topic, req.queue_id, req.timestamp_ms))

    def reset_offset(self, req: ResetOffset, call: Call) -> OffsetsReset:
        """RocketMQ's ``resetOffset`` (INVOKE_BROKER_TO_RESET_OFFSET): each queue of the
        topic gets the offset of its first message stored at or after the time (``force``
        false: only where that is behind the committed offset); the group's connected
        members are told (RESET_CONSUMER_CLIENT_OFFSET) so that they drop what they pulled
        and do not commit over it.  A commit may move an offset back, so this is a
        commit like a consumer's.  Pops (gRPC consumers) are not told: the pop service
        takes a queue's new offset at its next pop of the queue when nothing of it is in
        flight; an ack of a message popped before the reset may commit over it."""
        group, topic = req.group, req.topic
        self._master_only(group)
        self.topics.check_name(topic, allow_system=True)
        cfg = self.topics.get(topic)
        if cfg is None:
            raise TopicNotFound(f"topic {topic!r} does not exist")
        offsets = self.ctx.offsets
        old = {qid: offsets.query(group, topic, qid) for qid in range(cfg.queue_nums)}
        if (
            max(old.values(), default=-1) < 0
            and self.ctx.groups.get(group) is None
            and self.ctx.consumers.group(group) is None
        ):
            raise GroupNotFound(
                f"consumer group {group!r} has no offsets of topic {topic!r}, no config and "
                "no connected member on this broker"
            )
        rows, new = [], {}
        for qid, before in old.items():
            found = self.store.offset_by_time(topic, qid, req.timestamp_ms)
            after = found if req.force or before < 0 or found < before else before
            offsets.commit(group, topic, qid, after)
            new[qid] = after
            rows.append(QueueReset(queue_id=qid, old_offset=before, new_offset=after))
        try:
            offsets.persist()
        except OSError as exc:  # kept in memory: the periodic persist writes it later
            log.warning("offsets.json not written after the reset: %s", exc)
        told = self.ctx.consumers.tell(
            group,
            ResetConsumerClientOffset(
                group=group, topic=topic, broker_name=self.ctx.config.broker_name, offsets=new
            ),
        )
        log.info(
            "consumer group %s: offsets of %s reset to time %d (%s), %d member(s) told",
            group,
            topic,
            req.timestamp_ms,
            ", ".join(f"{r.queue_id}: {r.old_offset} -> {r.new_offset}" for r in rows),
            told,
        )
        return OffsetsReset(queues=rows, notified=told)

    def runtime_info(self, req: GetBrokerRuntimeInfo, call: Call) -> RuntimeInfo:
        return self._runtime_info()


def _group_row(group: str, cfg: GroupConfig) -> GroupConfigRow:
    return GroupConfigRow(group=group, fifo=cfg.fifo, retry_max_times=cfg.retry_max_times)
