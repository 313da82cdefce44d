"""A broker's role in its broker set: master or slave, the epoch, and (under a controller)
the lease that lets a master acknowledge writes.

Epoch fencing: under a controller a master acknowledges a write only while its lease runs
— ``lease_s`` from the moment it *sent* the heartbeat the controller confirmed.  The
controller elects a new master only after hearing nothing for ``heartbeat_timeout_s``
(longer than the lease) since the last heartbeat it *received*, so by then the old master
has stopped acknowledging: a deposed master never acknowledges a write.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

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
    master_ha_address: str = ""
    lease_until: float = 0.0
    #: set when the role changed (a master deposed, a slave promoted): wakes the loops
    changes: int = 0
    history: list[str] = field(default_factory=list)

    @property
    def name(self) -> BrokerRole:
        if not self.is_master:
            return BrokerRole.SLAVE
        return BrokerRole.SYNC_MASTER if self.replication == "sync" else BrokerRole.ASYNC_MASTER

    def may_acknowledge(self) -> bool:
        """Whether a write may be acknowledged now."""
        if not self.is_master:
            return False
        return not self.controlled or time.monotonic() < self.lease_until

    def renew(self, sent_at: float, lease_s: float) -> None:
        self.lease_until = max(self.lease_until, sent_at + lease_s)
