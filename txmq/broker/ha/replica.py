"""A broker's place in its broker set as the hot path sees it: its role and epochs, and the
HA service the slaves copy from.  What pulls ask (:class:`~txmq.broker.state.context.ReplicaView`:
is this the master, which replica should a reader pull from next) and what acknowledgements
ask (:class:`~txmq.broker.state.context.ReplicationGate`: may this write be acknowledged,
must it wait for a slave's copy) are answered here.  It is built before the broker's shared
context, which holds it; following a master and taking a controller's orders are
:mod:`.replication`'s."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from txmq.broker.ha.epochs import EpochLog
from txmq.broker.ha.master import HaService
from txmq.broker.ha.role import Role
from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.offsets import ConsumerOffsetManager
from txmq.broker.state.topics import TopicManager, has_queue
from txmq.broker.store import MessageStore
from txmq.protocol.rpc import Gate
from txmq.protocol.wire import HaMetadata

__all__ = ["Replica", "physical_memory"]

log = logging.getLogger("txmq.broker.ha")


def physical_memory() -> int:
    """The machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Replica:
    def __init__(
        self,
        config: BrokerConfig,
        store: MessageStore,
        topics: TopicManager,
        offsets: ConsumerOffsetManager,
        *,
        metadata: Callable[[], HaMetadata],
        on_caught_up: Callable[[], object],
        guard: Gate | None = None,
    ) -> None:
        """``metadata()``: what the slaves copy (topics, offsets, …); ``on_caught_up``:
        under a controller, a slave outside the proposed sync state set caught up;
        ``guard``: the broker's access control, on its HA port too."""
        self.topics = topics
        self.offsets = offsets
        self.epochs = EpochLog(config.store / "config" / "epochs.json")
        controlled = bool(config.controller_addresses)
        all_ack = config.all_ack_in_sync and controlled  # (no election without one)
        self.role = Role(
            replication=config.replication,
            is_master=not controlled and config.broker_id == 0,
            epoch=self.epochs.last.epoch,
            controlled=controlled,
            all_ack=all_ack,
        )
        self.service = HaService(
            store,
            self.role,
            self.epochs,
            metadata,
            in_sync_lag_s=(
                min(config.ha_in_sync_lag_s, config.sync_replication_timeout_s / 2)
                if all_ack
                else config.ha_in_sync_lag_s
            ),
            take_offsets=self.take_offsets,
            on_caught_up=on_caught_up,
            guard=guard,
        )
        store.writable = self.role.is_master
        #: a reader this far behind the log's end reads what the master no longer has in
        #: memory: its pull answer sends it to a slave (RocketMQ's
        #: accessMessageInMemoryMaxRatio of the machine's memory)
        self.slow_read_bytes = int(config.access_message_in_memory_max_ratio * physical_memory())

    # -- what the pulls ask (ReplicaView) ---------------------------------------------------

    def is_master(self) -> bool:
        return self.role.is_master

    def read_from(self, behind: int) -> int:
        """Where a reader ``behind`` bytes before the log's end pulls next: 0 the master, 1 a
        slave (RocketMQ's suggestWhichBrokerId)."""
        slow = behind > self.slow_read_bytes
        if self.role.is_master:
            return 1 if slow and self.service.slaves else 0
        return 1 if slow else 0  # a slave sends a reader that caught up back to the master

    def committable(self, group: str, topic: str, queue_id: int) -> bool:
        """Whether a consumer offset may be kept here (a group, a queue this broker has)."""
        return bool(group) and has_queue(self.topics, topic, queue_id)

    def take_offsets(self, offsets: dict[str, dict[str, dict[int, int]]]) -> None:
        """Keep the consumer offsets a slave took while this broker was away, where they
        are further than its own."""
        taken = self.offsets.commit_larger(offsets, self.committable)
        if taken:
            log.info("took %d consumer offset(s) a slave kept while this broker was away", taken)

    # -- the gate of acknowledgements (ReplicationGate) -------------------------------------

    def may_acknowledge(self) -> bool:
        return self.role.may_acknowledge()

    def sync_replication(self) -> bool:
        return self.role.is_master and self.role.replication == "sync"

    def when_copied(
        self, end_offset: int, done: Callable[[str], None], timeout_s: float
    ) -> str | None:
        return self.service.when_copied(end_offset, done, timeout_s)
