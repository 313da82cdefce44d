"""A slave's side of replication: follow the master's HA port, append what it sends.

Hello (its log's end and epoch history) → cut back a tail the master never had, or begin
an empty log at the master's oldest segment → ask for records again and again, each
request acknowledging everything before its offset → every few seconds, copy the master's
metadata.  A master that is down or refuses is tried again every second; the address to
follow comes from the name servers' answer to registration, the controller, or
``ha_master_address``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import anyio.abc

from txmq.broker.ha.epochs import EpochLog
from txmq.broker.store import MessageStore, ReplicaError
from txmq.errors import TxmqError
from txmq.remoting import RemotingClient
from txmq.wire import EpochEntry, HaGetMetadata, HaHello, HaMetadata, HaTransfer

__all__ = ["HaClient"]

log = logging.getLogger("txmq.broker.ha")

#: how long the master may hold a transfer that finds nothing new
WAIT_MS = 1000
RETRY_S = 1.0


class HaClient:
    """Copies the commit log of the master at :attr:`master` into this broker's store."""

    def __init__(
        self,
        store: MessageStore,
        epochs: EpochLog,
        *,
        broker_name: str,
        broker_id: int,
        master: str,
        metadata_interval_s: float,
        notify: Callable[[str, int], None],
        apply_metadata: Callable[[HaMetadata], object],
        address: Callable[[], str],
    ) -> None:
        """``notify(topic, queue_id)``: a queue got messages (wakes long polls);
        ``apply_metadata``: take the master's metadata."""
        self.store = store
        self.epochs = epochs
        self.broker_name = broker_name
        self.broker_id = broker_id
        self.metadata_interval_s = metadata_interval_s
        self._notify = notify
        self._apply_metadata = apply_metadata
        self._address = address
        #: the master's HA address to follow ("" : not known yet)
        self.master = master
        #: the master's commit-log end at its last answer, and when that answer came
        self.master_offset = 0
        self.last_contact = 0.0
        self.connected = False
        self._changed = anyio.Event()
        self._last_error = ""

    def follow(self, ha_address: str) -> None:
        """Follow this master from now on (a change drops the current connection)."""
        if ha_address and ha_address != self.master:
            log.info("following master %s", ha_address)
            self.master = ha_address
            self._changed.set()

    async def run(self) -> None:
        """Follow the master until cancelled."""
        while True:
            self._changed = anyio.Event()
            if not self.master:
                await self._changed.wait()
                continue
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._follow_until_changed)
                await self._changed.wait()
                tg.cancel_scope.cancel()

    async def _follow_until_changed(self) -> None:
        while True:
            address = self.master
            try:
                await self._follow(address)
            except Exception as raised:
                exc = _single(raised)
                if not isinstance(exc, (TxmqError, OSError, ReplicaError)):
                    raise
                self.connected = False
                why = f"{type(exc).__name__}: {exc}"
                if why != self._last_error:
                    log.warning(
                        "replication from %s stopped (%s); retrying every %gs",
                        address,
                        why,
                        RETRY_S,
                    )
                    self._last_error = why
            await anyio.sleep(RETRY_S)

    async def _follow(self, address: str) -> None:
        store = self.store
        async with RemotingClient(address, connect_timeout=3.0) as client:
            hello = HaHello(
                broker_name=self.broker_name,
                broker_id=self.broker_id,
                address=self._address(),
                offset=store.commit_log_max_offset,
                epochs=self.epochs.entries,
            )
            welcome = (await client.call(hello, timeout=10.0)).header
            if welcome.truncate_to >= 0:
                removed = await anyio.to_thread.run_sync(store.truncate_to, welcome.truncate_to)
                log.warning(
                    "cut %d bytes the master at %s never had (log now ends at %d)",
                    removed,
                    address,
                    welcome.truncate_to,
                )
            if welcome.start_at >= 0 and store.commit_log_max_offset == 0:
                store.start_replica_at(welcome.start_at)
            self.epochs.follow(welcome.epochs, store.commit_log_max_offset)
            self.connected = True
            if self._last_error:
                log.info("replicating from %s again", address)
            self._last_error = ""
            log.info(
                "replicating from master %s at offset %d (master at %d, epoch %d)",
                address,
                store.commit_log_max_offset,
                welcome.master_offset,
                welcome.epoch,
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._copy_metadata, client)
                await self._transfer(client)

    async def _transfer(self, client: RemotingClient) -> None:
        store = self.store
        broker_id = self.broker_id
        while True:
            offset = store.commit_log_max_offset
            got = await client.call(
                HaTransfer(broker_id=broker_id, offset=offset, wait_ms=WAIT_MS),
                timeout=WAIT_MS / 1000 + 10.0,
            )
            batch = got.header
            self.master_offset = batch.master_offset
            self.last_contact = time.monotonic()
            if batch.epoch > self.epochs.last.epoch:
                self.epochs.follow(
                    [*self.epochs.entries, EpochEntry(epoch=batch.epoch, start=batch.epoch_start)],
                    offset,
                )
            if got.body:
                touched = await anyio.to_thread.run_sync(
                    store.append_replicated, batch.offset, bytes(got.body)
                )
                for topic, queue_id in touched:
                    self._notify(topic, queue_id)

    async def _copy_metadata(self, client: RemotingClient) -> None:
        broker_id = self.broker_id
        while True:
            meta = (await client.call(HaGetMetadata(broker_id=broker_id), timeout=10.0)).header
            self._apply_metadata(meta)  # on the loop: topic changes wake the registration
            await anyio.sleep(self.metadata_interval_s)

    def lag_bytes(self) -> int:
        return max(self.master_offset - self.store.commit_log_max_offset, 0)


def _single(exc: BaseException) -> BaseException:
    """The one error inside (nested) task-group wrappers."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
