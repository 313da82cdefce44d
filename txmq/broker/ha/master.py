"""The master's side of replication: its HA port's handlers, what each slave has, and the
waits of SYNC_MASTER (group transfer).

Each slave asks for records from its log's end (:class:`HaTransfer`); that offset is also
its acknowledgement.  A write that must reach a slave (SYNC_MASTER) waits in a heap until
some slave acknowledges past its end — with ``all_ack`` (allAckInSyncStateSet) until every
slave of the sync state set has: one acknowledgement serves every write below it, as one
fsync serves every write of a group commit.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from txmq.broker.ha.epochs import EpochLog, cut_point
from txmq.broker.ha.role import Role
from txmq.broker.store import MessageStore, ReplicaError
from txmq.protocol.rpc import Call, Gate, Router
from txmq.protocol.wire import (
    HaBatch,
    HaGetMetadata,
    HaHandBackOffsets,
    HaHello,
    HaMetadata,
    HaTransfer,
    HaWelcome,
    WithBody,
)
from txmq.protocol.wire.errors import BadRequest, NotMaster

__all__ = ["HaService", "SlaveLink"]

log = logging.getLogger("txmq.broker.ha")

#: what one transfer carries at most
CHUNK = 1024 * 1024
#: under a controller, a slave of the sync state set that is not connected (it went, or
#: it has not reached a newly elected master yet) stays in the set for this long: writes
#: wait for it rather than being answered SLAVE_NOT_AVAILABLE at once
RECONNECT_GRACE_S = 3.0


@dataclass(slots=True)
class SlaveLink:
    """One slave, as the master sees it."""

    broker_id: int
    address: str
    #: the slave has every byte below this offset
    acked: int
    #: when it last asked (monotonic)
    last_seen: float
    #: when it last had everything the master had written (monotonic; 0: never yet)
    caught_up_at: float = 0.0
    #: the master's end when the slave asked (its lag is measured against that)
    master_offset_then: int = 0
    connection: object | None = None
    #: when the master last answered it (monotonic): its next request confirms that
    #: it still followed this master after that moment
    answered_at: float = 0.0

    def lag_bytes(self, master_offset: int) -> int:
        return max(master_offset - self.acked, 0)


class HaService:
    """Serves a broker set's slaves from this broker (when it is the master)."""

    def __init__(
        self,
        store: MessageStore,
        role: Role,
        epochs: EpochLog,
        metadata: Callable[[], HaMetadata],
        *,
        in_sync_lag_s: float = 15.0,
        take_offsets: Callable[[dict[str, dict[str, dict[int, int]]]], object],
        on_caught_up: Callable[[], object] = lambda: None,
        guard: Gate | None = None,
    ) -> None:
        """``metadata()``: what slaves copy; ``take_offsets``: keep the consumer offsets a
        slave took while this broker was away, where further than its own;
        ``on_caught_up``: under a controller, a slave outside the proposed sync state set
        caught up; ``guard``: the broker's access control, on its HA port too."""
        self.store = store
        self.role = role
        self.epochs = epochs
        self.metadata = metadata
        self.take_offsets = take_offsets
        self.in_sync_lag_s = in_sync_lag_s
        self.slaves: dict[int, SlaveLink] = {}
        #: the end of the newest write a slave's confirmation acknowledged
        self.confirmed_end = 0
        #: when each slave last disconnected, and when this broker became the master
        self._gone_at: dict[int, float] = {}
        self.promoted_at = 0.0
        #: grows with every change of the metadata slaves copy at once (topics)
        self.meta_version = 0
        self.on_caught_up = on_caught_up
        #: writes waiting for a slave: (end offset, seq, what to call with the outcome —
        #: "" copied, else the status to answer —, deadline); one timer for the earliest
        self._waiters: list[tuple[int, int, Callable[[str], None], float]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._seq = itertools.count()
        self._written: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self.router = Router("this broker's HA port", guard)
        self.router.route(HaHello, self.hello)
        self.router.route(HaTransfer, self.transfer)
        self.router.route(HaGetMetadata, self.get_metadata)
        self.router.route(HaHandBackOffsets, self.hand_back_offsets)

    def bind(self) -> None:
        """Called on the broker's event loop once it runs: the store's writers (some in
        worker threads) wake waiting transfers through it."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.store.on_append = self.written

    # -- handlers ---------------------------------------------------------------------------

    def hello(self, req: HaHello, call: Call) -> HaWelcome:
        if not self.role.serves:
            raise NotMaster("this broker is not its broker set's master: ask the master")
        end = self.store.commit_log_max_offset
        mine = self.epochs.entries
        truncate_to = start_at = -1
        if req.offset == 0 and self.store.commit_log_min_offset > 0:
            start_at = self.store.commit_log_min_offset
        else:
            cut = cut_point(req.epochs or mine[:1], req.offset, mine, end)
            if cut is not None:
                if not self.role.controlled and cut >= end:
                    raise BadRequest(
                        f"slave {req.broker_id} has {req.offset - end} bytes more than this "
                        f"master ({req.offset} > {end}): without a controller nothing is cut; "
                        "move that slave's store aside if the master's is the right one"
                    )
                truncate_to = cut
            elif req.offset < self.store.commit_log_min_offset:
                raise BadRequest(
                    f"slave {req.broker_id} ends at {req.offset}, before this master's oldest "
                    f"record ({self.store.commit_log_min_offset}): give it an empty store"
                )
        acked = truncate_to if truncate_to >= 0 else max(start_at, req.offset)
        old = self.slaves.get(req.broker_id)
        now = time.monotonic()
        link = SlaveLink(
            req.broker_id,
            req.address,
            acked,
            now,
            old.caught_up_at if old is not None else 0.0,
            end,
            call.conn,
        )
        self.slaves[req.broker_id] = link
        call.conn.on_close.append(lambda _: self._gone(link))
        log.info(
            "slave %d (%s) connected from offset %d%s",
            req.broker_id,
            req.address or "?",
            req.offset,
            f"; it cuts its log back to {truncate_to}" if truncate_to >= 0 else "",
        )
        return HaWelcome(
            epoch=self.role.epoch,
            epochs=mine,
            master_offset=end,
            truncate_to=truncate_to,
            start_at=start_at,
        )

    def transfer(
        self, req: HaTransfer, call: Call
    ) -> WithBody[HaBatch] | Awaitable[WithBody[HaBatch]]:
        link = self.slaves.get(req.broker_id)
        if link is None or link.connection is not call.conn:
            raise BadRequest("say hello first (HaHello) on this connection")
        if not self.role.serves:
            raise NotMaster("this broker is no longer its broker set's master")
        self._acked(link, req.offset)
        batch = self._batch(link, req.offset)
        if batch[1] or req.wait_ms == 0:
            return batch
        return self._wait_for_records(req, link)

    async def _wait_for_records(self, req: HaTransfer, link: SlaveLink) -> WithBody[HaBatch]:
        deadline = time.monotonic() + req.wait_ms / 1000
        while True:
            event = self._written
            if event is None:
                event = self._written = anyio.Event()
            batch = self._batch(link, req.offset)
            left = deadline - time.monotonic()
            if batch[1] or left <= 0 or not self.role.serves:
                return batch
            with anyio.move_on_after(left):
                await event.wait()

    def _batch(self, link: SlaveLink, offset: int) -> WithBody[HaBatch]:
        link.answered_at = time.monotonic()  # (the answer leaves after this moment)
        try:
            data = self.store.read_records(offset, CHUNK)
        except ReplicaError as exc:
            raise BadRequest(f"cannot send from offset {offset}: {exc}") from None
        last = self.epochs.last
        return WithBody(
            HaBatch(
                offset=offset,
                master_offset=self.store.commit_log_max_offset,
                epoch=self.role.epoch,
                epoch_start=last.start,
                meta_version=self.meta_version,
            ),
            data,
        )

    def get_metadata(self, req: HaGetMetadata, call: Call) -> HaMetadata:
        if not self.role.serves:
            raise NotMaster("this broker is no longer its broker set's master")
        return self.metadata()

    def hand_back_offsets(self, req: HaHandBackOffsets, call: Call) -> HaMetadata:
        if not self.role.is_master:
            raise NotMaster("this broker is not its broker set's master")
        self.take_offsets(req.offsets)
        return self.metadata()

    # -- acknowledgements -------------------------------------------------------------------

    def _acked(self, link: SlaveLink, offset: int) -> None:
        now = time.monotonic()
        link.last_seen = now
        if offset > link.acked:
            link.acked = offset
        if link.acked >= link.master_offset_then:
            if (
                self.role.is_master
                and self.role.controlled
                and link.broker_id not in self.role.proposed
            ):
                self.on_caught_up()  # propose it now, not at the next heartbeat
            link.caught_up_at = now
        link.master_offset_then = self.store.commit_log_max_offset
        counts = self.role.counts(link.broker_id)
        if counts and self.role.controlled and link.answered_at:
            self.role.renew(link.answered_at)
        if self.role.all_ack:
            if not self.role.controlled or link.broker_id in self.role.members():
                self._release(self._all_acked())
        elif counts:
            self._release(link.acked)

    def _all_acked(self) -> int:
        """all_ack: the offset below which every slave that must confirm has everything (0
        while one of them is not connected)."""
        ids = self.role.members() if self.role.controlled else frozenset(self.slaves)
        ends = [self.slaves[i].acked if i in self.slaves else 0 for i in ids]
        return min(ends) if ends else 0

    def _release(self, acked: int) -> None:
        """Acknowledge the writes waiting for a confirmation below ``acked``."""
        waiters = self._waiters
        while waiters and waiters[0][0] <= acked:
            end, _, done, _ = heapq.heappop(waiters)
            self.confirmed_end = max(self.confirmed_end, end)
            done("")

    def _just_promoted(self) -> bool:
        return self.role.controlled and time.monotonic() - self.promoted_at <= RECONNECT_GRACE_S

    def recheck(self) -> None:
        """The sync state set changed: a slave that counts now may have confirmed already
        (all_ack: the one left out may have been all the writes waited for)."""
        if self.role.all_ack:
            self._release(self._all_acked())
            return
        counting = [s.acked for s in self.slaves.values() if self.role.counts(s.broker_id)]
        if counting:
            self._release(max(counting))

    def _gone(self, link: SlaveLink) -> None:
        if self.slaves.get(link.broker_id) is link:
            del self.slaves[link.broker_id]
            self._gone_at[link.broker_id] = time.monotonic()
            log.warning("slave %d (%s) disconnected", link.broker_id, link.address or "?")

    def written(self) -> None:
        """The store appended something: wake the transfers waiting for it (thread-safe)."""
        event = self._written
        if event is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._written = None
            event.set()
        elif self._loop is not None:
            self._loop.call_soon_threadsafe(self.written)

    def when_copied(
        self, end_offset: int, done: Callable[[str], None], timeout_s: float
    ) -> str | None:
        """SYNC_MASTER's wait for a slave (group transfer: one confirmation releases every
        write below it).  A status at once — "" when a slave of the sync state set has
        everything below ``end_offset`` already, "SLAVE_NOT_AVAILABLE" when none can — or
        None, and later ``done("")`` once one has, or ``done("FLUSH_SLAVE_TIMEOUT")``
        after ``timeout_s``.  One timer serves every write waiting (not one each)."""
        if self.role.controlled:
            ids = self.role.in_sync & self.role.proposed  # connected or not (yet)
            if self.role.all_ack:
                ids = self.role.members()
        else:
            ids = frozenset(self.slaves)
        # a slave catching up may join the set soon, and a new master's slaves come
        if not ids and not self.slaves and not self._just_promoted():
            return "SLAVE_NOT_AVAILABLE"
        if self.role.all_ack:
            if ids and self._all_acked() >= end_offset:
                self.confirmed_end = max(self.confirmed_end, end_offset)
                return ""
        else:
            for i in ids:
                s = self.slaves.get(i)
                if s is not None and s.acked >= end_offset:
                    self.confirmed_end = max(self.confirmed_end, end_offset)
                    return ""
        deadline = time.monotonic() + timeout_s
        heapq.heappush(self._waiters, (end_offset, next(self._seq), done, deadline))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)
        return None

    def _expire(self) -> None:
        """The oldest waiting writes (the lowest offsets) whose time is up: answered."""
        self._timer = None
        waiters = self._waiters
        now = time.monotonic()
        while waiters and waiters[0][3] <= now:
            heapq.heappop(waiters)[2]("FLUSH_SLAVE_TIMEOUT")
        if waiters:
            delay = max(waiters[0][3] - now, 0.001)
            self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    # -- what admin shows -------------------------------------------------------------------

    def in_sync(self) -> list[int]:
        """The slaves that had everything the master had within the last in_sync_lag_s
        (under a controller also those of the sync state set not connected for less than
        RECONNECT_GRACE_S since they went or since this broker became the master)."""
        now = time.monotonic()
        out = {
            s.broker_id
            for s in self.slaves.values()
            if s.caught_up_at and now - s.caught_up_at <= self.in_sync_lag_s
        }
        if self.role.controlled:
            for i in self.role.in_sync - self.slaves.keys():
                if now - max(self.promoted_at, self._gone_at.get(i, 0.0)) <= RECONNECT_GRACE_S:
                    out.add(i)
        return sorted(out)

    def propose(self) -> frozenset[int]:
        """The sync state set this master asks its controller for: the slaves in sync now,
        and of those approved but no longer in sync, those it cannot drop yet — every
        write acknowledged so far must stay on some slave of the set (the election picks
        the slave of the set that reaches furthest), unless the set is left with no slave
        (then only the master can be elected)."""
        now_in_sync = frozenset(self.in_sync())
        if self.role.all_ack:
            return now_in_sync  # every member has every acknowledged write: drop freely
        approved = self.role.in_sync
        dropped = approved - now_in_sync
        if dropped and now_in_sync:
            furthest = max(self.slaves[i].acked if i in self.slaves else 0 for i in now_in_sync)
            if furthest < self.confirmed_end:
                return now_in_sync | dropped  # not yet: the rest lacks a write they confirmed
        return now_in_sync

    def lag(self) -> dict[int, tuple[int, float]]:
        """Each slave's lag: (bytes behind, seconds since it last had everything)."""
        end = self.store.commit_log_max_offset
        now = time.monotonic()
        return {
            s.broker_id: (
                s.lag_bytes(end),
                0.0 if s.acked >= end else now - s.caught_up_at if s.caught_up_at else -1.0,
            )
            for s in self.slaves.values()
        }

    def drop_waiters(self) -> None:
        """A master deposed: no write still waiting is acknowledged."""
        waiters, self._waiters = self._waiters, []
        for _, _, done, _ in waiters:
            done("DEPOSED")  # (answered NOT_MASTER: this broker is no longer the master)
