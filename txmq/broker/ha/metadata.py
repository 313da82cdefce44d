"""Metadata a slave copies from its master (RocketMQ's SlaveSynchronize): topics,
consumer-group configs, consumer offsets, delay-level offsets and transaction-check
offsets, each in its state file's own JSON form (one schema per file, :mod:`txmq.server.jsonfile`).

Offsets are taken only once the slave's commit log reaches the master's end at the time
the master took them: an offset past a record the slave lacks would skip that record on
the slave if it became the master (a delayed message never delivered, a half message
never checked).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from txmq.broker.delivery.schedule import DelayOffsetsFile, ScheduleMessageService
from txmq.broker.state.context import BrokerContext
from txmq.broker.state.offsets import OffsetsFile
from txmq.broker.state.subscriptions import GroupsFile
from txmq.broker.state.topics import TopicEntry, TopicsFile, has_queue
from txmq.broker.transactions.service import TransactionOffsetsFile, TransactionService
from txmq.protocol.wire import HaMetadata
from txmq.server.jsonfile import write_json_atomic

__all__ = ["Metadata"]

log = logging.getLogger("txmq.broker.ha")


@dataclass(slots=True)
class Metadata:
    ctx: BrokerContext
    schedule: ScheduleMessageService
    transactions: TransactionService

    def take(self) -> HaMetadata:
        """The master's side: its tables now."""
        ctx = self.ctx
        end = ctx.store.commit_log_max_offset
        topics = TopicsFile(
            {c.name: TopicEntry(c.name, c.queue_nums, c.system) for c in ctx.topics.all()}
        )
        svc = self.transactions
        tx = msgspec.json.encode(svc.offsets_file()) if svc.ready else b""
        return HaMetadata(
            log_end=end,
            topics=msgspec.json.encode(topics),
            offsets=msgspec.json.encode(OffsetsFile(ctx.offsets.snapshot())),
            delay_offsets=msgspec.json.encode(DelayOffsetsFile(self.schedule.offsets())),
            transaction_offsets=tx,
            groups=msgspec.json.encode(GroupsFile(ctx.groups.snapshot())),
        )

    def apply(self, meta: HaMetadata) -> bool:
        """A slave's side: take the master's tables; False if the slave's log has not
        reached ``meta.log_end`` yet (the topics and group configs are taken anyway)."""
        ctx = self.ctx
        if meta.topics:
            ctx.topics.adopt(msgspec.json.decode(meta.topics, type=TopicsFile).topics)
            # an offset kept for a queue the master no longer has is not handed back
            ctx.offsets.drop_pending(
                lambda group, topic, queue_id: has_queue(ctx.topics, topic, queue_id)
            )
        if meta.groups:  # (an older master sends none: the slave keeps its own)
            ctx.groups.adopt(msgspec.json.decode(meta.groups, type=GroupsFile).groups)
        if ctx.store.commit_log_max_offset < meta.log_end:
            return False
        if meta.offsets:
            ctx.offsets.adopt(msgspec.json.decode(meta.offsets, type=OffsetsFile).offsets)
        if meta.delay_offsets:
            delay = msgspec.json.decode(meta.delay_offsets, type=DelayOffsetsFile)
            write_json_atomic(self.schedule.path, delay)
        if meta.transaction_offsets:
            tx = msgspec.json.decode(meta.transaction_offsets, type=TransactionOffsetsFile)
            write_json_atomic(self.transactions.path, tx)
        return True
