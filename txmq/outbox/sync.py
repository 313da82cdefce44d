"""A relay for blocking applications: the async relay on an event loop in a thread.

::

    with outbox.sync.OutboxRelay("sqlite:///app.db", "127.0.0.1:10911") as relay:
        ...                                   # your Flask/Django process keeps running
        print(relay.lag_seconds(), relay.backlog())
"""

from __future__ import annotations

from typing import Any

from txmq.client.facade import SyncClient
from txmq.outbox import relay as _relay
from txmq.outbox.store import OutboxStats

__all__ = ["OutboxRelay"]


class OutboxRelay(SyncClient[_relay.OutboxRelay]):
    """The blocking twin of :class:`outbox.OutboxRelay` (same arguments); ``aio`` is the
    async relay it runs on a background event loop."""

    def __init__(self, db: Any, broker: Any = None, **kwargs: Any) -> None:
        super().__init__(_relay.OutboxRelay(db, broker, **kwargs))

    def lag_seconds(self) -> float:
        """Age of the oldest unsent row, in seconds."""
        return float(self._call(self.aio.lag_seconds))

    def backlog(self) -> int:
        """How many rows wait to be sent."""
        return int(self._call(self.aio.backlog))

    def stats(self) -> OutboxStats:
        """Backlog, lag, parked and sent rows."""
        result: OutboxStats = self._call(self.aio.stats)
        return result
