"""A relay for blocking applications: the async relay on an event loop in a thread.

::

    with outbox.sync.OutboxRelay("sqlite:///app.db", "127.0.0.1:10911") as relay:
        ...                                   # your Flask/Django process keeps running
        print(relay.lag_seconds(), relay.backlog())
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Self

from anyio.from_thread import BlockingPortal, start_blocking_portal

from outbox import relay as _relay
from outbox.store import OutboxStats

__all__ = ["OutboxRelay"]


class OutboxRelay:
    """The blocking twin of :class:`outbox.OutboxRelay` (same arguments); ``aio`` is the
    async relay it runs on a background event loop."""

    def __init__(self, db: Any, broker: Any = None, **kwargs: Any) -> None:
        self._args = (db, broker, kwargs)
        self.aio: _relay.OutboxRelay | None = None
        self._cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None

    def start(self) -> Self:
        if self._portal is not None:
            return self
        cm = start_blocking_portal()
        portal = cm.__enter__()
        try:
            db, broker, kwargs = self._args
            # made on the loop: engines and producers belong to the loop they run on
            self.aio = portal.call(_make, db, broker, kwargs)
            portal.call(self.aio.start)
        except BaseException:
            cm.__exit__(None, None, None)
            raise
        self._cm, self._portal = cm, portal
        return self

    def stop(self) -> None:
        portal, cm = self._portal, self._cm
        if portal is None or cm is None or self.aio is None:
            return
        self._portal = self._cm = None
        try:
            portal.call(self.aio.stop)
        finally:
            cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, name: str) -> Any:
        if self._portal is None or self.aio is None:
            raise RuntimeError("the relay is not started: call start() or use 'with'")
        return self._portal.call(getattr(self.aio, name))

    def lag_seconds(self) -> float:
        """Age of the oldest unsent row, in seconds."""
        return float(self._call("lag_seconds"))

    def backlog(self) -> int:
        """How many rows wait to be sent."""
        return int(self._call("backlog"))

    def stats(self) -> OutboxStats:
        """Backlog, lag, parked and sent rows."""
        result: OutboxStats = self._call("stats")
        return result


async def _make(db: Any, broker: Any, kwargs: dict[str, Any]) -> _relay.OutboxRelay:
    return _relay.OutboxRelay(db, broker, **kwargs)
