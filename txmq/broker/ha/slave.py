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
from txmq.protocol.peer import RemotingClient
from txmq.protocol.wire import (
    EpochEntry,
    HaGetMetadata,
    HaHandBackOffsets,
    HaHello,
    HaMetadata,
    HaTransfer,
)
from txmq.protocol.wire.errors import NotMaster, TxmqError
from txmq.security.client import ClientSecurity

__all__ = ["HaClient"]

log = logging.getLogger("txmq.broker.ha")

#: how long the master may hold a transfer that finds nothing new
WAIT_MS = 1000
#: a batch up to this size is appended on the event loop (a memory copy and a few index
#: entries; a thread hop would cost more and delay the acknowledgement SYNC_MASTER waits for)
INLINE_APPEND = 256 * 1024
#: a master that is down, refuses, or is not the master of the epoch yet: try again after
RETRY_S = 0.25


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
        pending_offsets: Callable[[], dict[str, dict[str, dict[int, int]]]] = dict,
        security: ClientSecurity | None = None,
    ) -> None:
        """``notify(topic, queue_id)``: a queue got messages (wakes long polls);
        ``apply_metadata``: take the master's metadata; ``security``: how to reach the
        master's HA port (the broker's peer_security())."""
        self.store = store
        self.security = security
        self.epochs = epochs
        self.broker_name = broker_name
        self.broker_id = broker_id
        self.metadata_interval_s = metadata_interval_s
        self._notify = notify
        self._apply_metadata = apply_metadata
        self._address = address
        self._pending_offsets = pending_offsets
        #: the master's HA address to follow ("" : not known yet)
        self.master = master
        #: the master's commit-log end at its last answer, and when that answer came
        self.master_offset = 0
        self.last_contact = 0.0
        self.connected = False
        #: under a controller: a master of an older epoch is not followed
        self.min_epoch = 0
        self._changed = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._last_error = ""
        #: the master's metadata version last seen, and an event to copy it at once
        self._meta_version = -1
        self._copy_now = anyio.Event()

    @property
    def following(self) -> bool:
        """Whether it copies (or tries to copy) from a master."""
        return bool(self.master) or not self._idle.is_set()

    def silent_ms(self) -> int:
        """How long since the master last answered (-1: never)."""
        if not self.last_contact:
            return -1
        return int((time.monotonic() - self.last_contact) * 1000)

    def follow(self, ha_address: str, min_epoch: int = 0) -> None:
        """Follow this master from now on (a change drops the current connection)."""
        self.min_epoch = max(self.min_epoch, min_epoch)
        if ha_address and ha_address != self.master:
            log.info("following master %s", ha_address)
            self.master = ha_address
            self._changed.set()

    async def stop(self) -> None:
        """Stop copying (fenced, or about to be the master); returns once no append is
        under way and none will start."""
        if self.master:
            log.info("no longer following master %s", self.master)
        self.master = ""
        self.connected = False
        self._changed.set()
        await self._idle.wait()

    async def run(self) -> None:
        """Follow the master until cancelled."""
        while True:
            self._changed = anyio.Event()
            if not self.master:
                await self._changed.wait()
                continue
            self._idle = anyio.Event()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._follow_until_changed)
                    await self._changed.wait()
                    tg.cancel_scope.cancel()
            finally:
                self.connected = False
                self._idle.set()

    async def _follow_until_changed(self) -> None:
        while True:
            address = self.master
            try:
                await self._follow(address)
            except Exception as raised:
                exc = _expected(raised)
                if exc is None:
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
        async with RemotingClient(address, connect_timeout=3.0, security=self.security) as client:
            hello = HaHello(
                broker_name=self.broker_name,
                broker_id=self.broker_id,
                address=self._address(),
                offset=store.commit_log_max_offset,
                epochs=self.epochs.entries,
            )
            welcome = (await client.call(hello, timeout=10.0)).header
            if welcome.epoch < self.min_epoch:
                raise NotMaster(
                    f"{address} is the master of epoch {welcome.epoch}, not yet of {self.min_epoch}"
                )
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
            if batch.meta_version != self._meta_version:
                self._meta_version = batch.meta_version
                self._copy_now.set()
            if got.body:
                body = bytes(got.body)
                if len(body) <= INLINE_APPEND:  # a few writes: at once (its ack is sooner)
                    touched = store.append_replicated(batch.offset, body)
                else:
                    touched = await anyio.to_thread.run_sync(
                        store.append_replicated, batch.offset, body
                    )
                for topic, queue_id in touched:
                    self._notify(topic, queue_id)

    async def _copy_metadata(self, client: RemotingClient) -> None:
        broker_id = self.broker_id
        while True:
            self._copy_now = anyio.Event()
            pending = self._pending_offsets()
            if pending:  # consumers committed here while the master was away: hand back
                request: HaGetMetadata | HaHandBackOffsets = HaHandBackOffsets(
                    broker_id=broker_id, offsets=pending
                )
                log.info("handing %d consumer offset(s) back to the master", _count(pending))
            else:
                request = HaGetMetadata(broker_id=broker_id)
            meta = (await client.call(request, timeout=10.0)).header
            self._apply_metadata(meta)  # on the loop: topic changes wake the registration
            with anyio.move_on_after(self.metadata_interval_s):
                await self._copy_now.wait()

    def lag_bytes(self) -> int:
        return max(self.master_offset - self.store.commit_log_max_offset, 0)


def _count(offsets: dict[str, dict[str, dict[int, int]]]) -> int:
    return sum(len(q) for topics in offsets.values() for q in topics.values())


def _expected(exc: BaseException) -> BaseException | None:
    """The first error inside (nested) task-group wrappers when every one of them is what a
    lost or refusing master raises (the transfer and the metadata copy often fail
    together); None when any is not (a bug: it propagates)."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [_expected(e) for e in exc.exceptions]
        return leaves[0] if leaves and all(leaf is not None for leaf in leaves) else None
    return exc if isinstance(exc, (TxmqError, OSError, ReplicaError)) else None
