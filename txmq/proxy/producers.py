"""The proxy's gRPC producers by producer group, and the check-backs the brokers send the
proxy for them.

The endpoint registers a producer's Telemetry session here under each topic it publishes
(a RocketMQ 5 client's producer group is its topic).  The proxy heartbeats every broker
set's master as a producer of each group that has a session, so a broker's transaction
checker sends a half message's CHECK_TRANSACTION_STATE to the proxy, which hands it to one
session of the group (round robin): the client's EndTransaction comes back through the
endpoint to the broker set the transaction id names.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from txmq.protocol.wire import CheckTransactionState

__all__ = ["ProxyProducers"]

log = logging.getLogger("txmq.proxy")


class ProxyProducers:
    """producer group -> client id -> its session (the endpoint's ProducerRegistry)."""

    def __init__(self, changed: Callable[[str, bool], None] = lambda group, joined: None) -> None:
        """``changed(group, joined)``: a group got its first session (True) or lost its
        last (False)."""
        self._groups: dict[str, dict[str, Any]] = {}
        self._turns = itertools.count()
        self.changed = changed

    def register(self, group: str, client_id: str, conn: Any) -> None:
        members = self._groups.get(group)
        if members is None:
            members = self._groups[group] = {}
            members[client_id] = conn
            self.changed(group, True)
            return
        members[client_id] = conn

    def unregister(self, group: str, client_id: str) -> None:
        members = self._groups.get(group)
        if members is None or members.pop(client_id, None) is None or members:
            return
        del self._groups[group]
        self.changed(group, False)

    def groups(self) -> list[str]:
        """The producer groups that have a session now."""
        return sorted(self._groups)

    def check_back(self, check: CheckTransactionState, record: bytes) -> bool:
        """Hand a broker's check-back to a session of its group (False: none is open; the
        broker asks again at its next check)."""
        members = [c for c in self._groups.get(check.group, {}).values() if not c.closed]
        if not members:
            log.debug(
                "check-back of %s (group %s, broker set %s): no producer of the group is "
                "connected to this proxy",
                check.msg_id,
                check.group,
                check.broker_name,
            )
            return False
        session = members[next(self._turns) % len(members)]
        session.send_oneway(check, record)
        return True
