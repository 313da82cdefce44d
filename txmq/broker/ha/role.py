"""A broker's role in its broker set: master or slave, the epoch, and (under a controller)
the sync state set and the lease that let a master acknowledge writes.

Epoch fencing under a controller (``namesrv/controller.py`` has the whole argument): every
acknowledgement needs the lease — ``lease_s`` from when the broker *sent* a heartbeat the
controller answered, or from when it sent the answer that a slave of the sync state set
confirmed next.  The controller elects a new master only after that lease has run out, so
no acknowledgement leaves a master after another may have been elected: not an
ASYNC_MASTER's, not SYNC_MASTER's FLUSH_SLAVE_TIMEOUT / SLAVE_NOT_AVAILABLE, and not a
SYNC_MASTER's SEND_OK either (a fenced slave confirms nothing, but a master paused past its
lease may, when it resumes, read confirmations its slaves sent before the pause; answering
from those would be safe — the bytes are on the slaves — but not by design).  A master
whose sync state set has no slave (and that proposed none) needs no lease: no one else can
be elected.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

__all__ = ["BrokerRole", "Role"]


class BrokerRole(enum.StrEnum):
    """RocketMQ's brokerRole."""

    ASYNC_MASTER = "ASYNC_MASTER"
    SYNC_MASTER = "SYNC_MASTER"
    SLAVE = "SLAVE"


@dataclass(slots=True)
class Role:
    #: replication mode when master: "sync" (SYNC_MASTER) or "async"
    replication: str
    is_master: bool
    epoch: int
    #: under a controller: masters need a lease to acknowledge
    controlled: bool = False
    #: this broker's set's master (for a slave: whom it copies from)
    master_address: str = ""
    lease_until: float = 0.0
    #: the lease's length, as the controller last gave it
    lease_s: float = 0.0
    #: under a controller: the slaves whose confirmations count (approved by the
    #: controller), and what this master proposed last
    in_sync: frozenset[int] = frozenset()
    proposed: frozenset[int] = frozenset()
    #: the broker id the set's master has in its own configuration (-1: not known)
    master_id: int = -1
    #: a master that stopped acknowledging for an election still serves its log to the
    #: slaves (a switchover's target catches up from it) until it follows another master
    stepped_down: bool = False
    #: a master stopping cleanly, handing its role to a slave
    handing_over: bool = False
    #: SYNC_MASTER acknowledges once every slave of the sync state set has a write
    #: (RocketMQ 5's allAckInSyncStateSet), not one
    all_ack: bool = False

    @property
    def serves(self) -> bool:
        """Whether slaves may copy from this broker."""
        return self.is_master or self.stepped_down

    @property
    def name(self) -> BrokerRole:
        if not self.is_master:
            return BrokerRole.SLAVE
        return BrokerRole.SYNC_MASTER if self.replication == "sync" else BrokerRole.ASYNC_MASTER

    def may_acknowledge(self) -> bool:
        """Whether a write may be acknowledged now: this broker is the master and, under a
        controller with a sync state set, its lease runs (however the write was
        confirmed)."""
        if not self.is_master:
            return False
        if not self.controlled or not (self.in_sync or self.proposed):
            return True
        return time.monotonic() < self.lease_until

    def counts(self, broker_id: int) -> bool:
        """Whether this slave's confirmations count (every slave's without a controller;
        with one, those of the sync state set that this master still proposes)."""
        if not self.controlled:
            return True
        return broker_id in self.in_sync and broker_id in self.proposed

    def members(self) -> frozenset[int]:
        """Under all_ack and a controller: the slaves that must all have a write before it
        is acknowledged — those approved and those proposed alike (while the set grows, the
        newcomer counts at once; while it shrinks, the one leaving counts until the
        controller saved the smaller set: whichever set the controller holds, each of its
        members has every acknowledged write)."""
        return self.in_sync | self.proposed

    def renew(self, sent_at: float, lease_s: float | None = None) -> None:
        length = self.lease_s if lease_s is None else lease_s
        self.lease_until = max(self.lease_until, sent_at + length)
