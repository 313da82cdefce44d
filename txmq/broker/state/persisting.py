"""State a broker service keeps in a JSON file of its own (the delay levels' offsets, the
timer's checkpoint): saved every ``persist_interval_s`` when it changed, in a worker thread,
and at shutdown."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio

from txmq.broker.store import MessageStore
from txmq.broker.store.types import StoreError
from txmq.server.jsonfile import write_json_atomic

__all__ = ["SavedState"]

log = logging.getLogger("txmq.broker")


class SavedState:
    """A mixin: the class sets ``path``, ``store``, ``persist_interval_s``, ``_dirty`` and
    ``what`` (for the log), and makes :meth:`_snapshot`."""

    path: Path
    store: MessageStore
    persist_interval_s: float
    _dirty: bool
    #: what the file holds, as a log line names it
    what = "state"

    def _snapshot(self, force: bool) -> Any:
        """What to save, or None if nothing changed (``force``: save anyway)."""
        raise NotImplementedError

    def _flushed_to(self, data: Any) -> int | None:
        """A commit-log offset the store must have flushed before ``data`` is saved."""
        return None

    def persist(self, force: bool = False) -> None:
        """Save now (the broker calls it at shutdown)."""
        data = self._snapshot(force)
        if data is not None:
            write_json_atomic(self.path, data)

    async def _persist_loop(self) -> None:
        while True:
            await anyio.sleep(self.persist_interval_s)
            data = self._snapshot(False)
            if data is None:
                continue
            try:
                upto = self._flushed_to(data)
                if upto is not None:
                    await self.store.wait_flushed(upto)
                await anyio.to_thread.run_sync(write_json_atomic, self.path, data)
            except StoreError:  # the store stopped: shutdown saves it
                return
            except OSError as exc:
                self._dirty = True
                if not self.store.disk.absorb(exc):  # a full disk is logged once, there
                    log.exception("persisting %s failed", self.what)
