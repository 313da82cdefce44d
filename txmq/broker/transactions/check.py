"""Checking undecided half messages back with their producer group.

Every ``transaction_check_interval_s`` the checker walks the pending halves (oldest first).
A half older than its immunity (``transaction_timeout_s``, or its own
CHECK_IMMUNITY_TIME_IN_SECONDS property) is sent as a oneway CHECK_TRANSACTION_STATE to one
live producer connection of its group (round robin between checks); the producer answers
with END_TRANSACTION (``from_check``).  With no live producer of the group the half waits
for the next round and the round does not count.  A half still pending after
``transaction_check_max`` checks is parked (see :meth:`TransactionService.park`).

Check counts are kept in memory and saved, with the check offset (the half topic's queue
offset of the oldest pending half) and the op offset (where recovery starts reading op
records), in ``<store>/config/transaction_offsets.json`` after every round that changed
something and at shutdown.  After a crash the counts restart from the last saved round: a
half may be checked a few times more than the limit, never fewer.  The file is written only
once the op records it relies on are on disk.
"""

from __future__ import annotations

import logging
import time

import anyio
import anyio.abc
import anyio.to_thread

from txmq.broker.state.context import BrokerContext
from txmq.broker.state.groups import channel_user
from txmq.broker.store import CQ_TAG_PROPERTY, PutStatus
from txmq.broker.transactions.service import (
    PARKED,
    PendingHalf,
    TransactionOffsetsFile,
    TransactionService,
)
from txmq.protocol.codec import decode_record
from txmq.protocol.message import PARKED_TOPIC, Prop
from txmq.protocol.rpc import Call
from txmq.protocol.wire import (
    CheckTransactionState,
    GetTransactions,
    TransactionList,
    TransactionRow,
)
from txmq.protocol.wire.errors import TxmqError
from txmq.server.jsonfile import write_json_atomic

__all__ = ["TransactionChecker"]

log = logging.getLogger("txmq.broker.transaction")

#: what to save: (file content, commit-log offset that must be flushed first)
Snapshot = tuple[TransactionOffsetsFile, int]
MAX_LIST = 1000


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class TransactionChecker:
    """The check rounds, parking, GET_TRANSACTIONS and the offsets file."""

    def __init__(self, ctx: BrokerContext, service: TransactionService) -> None:
        self.ctx = ctx
        self.service = service
        self.store = ctx.store
        self.interval_s = ctx.config.transaction_check_interval_s
        self.check_max = ctx.config.transaction_check_max
        self.flush_timeout_s = ctx.config.sync_flush_timeout_s
        self._next: dict[str, int] = {}
        #: rounds run and checks sent since start (for tests and runtime info)
        self.rounds = 0
        self.checks_sent = 0

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Check pending halves every interval until cancelled (the broker's task group)."""
        task_status.started()
        while True:
            await anyio.sleep(self.interval_s)
            try:
                self.check_round()
            except Exception:  # pragma: no cover - a bug must not stop later rounds
                log.exception("transaction check round failed")
            self.rounds += 1
            snap = self.snapshot()
            if snap is not None:
                try:
                    await anyio.to_thread.run_sync(self._write, snap)
                except OSError as exc:
                    self.service.dirty = True
                    if not self.store.disk.absorb(exc):  # a full disk is logged once, there
                        log.exception("persisting transaction offsets failed")

    def check_round(self, *, immune_too: bool = False) -> int:
        """Send the checks that are due (``immune_too``: also of halves still in their
        immunity, as a test asks); return how many were sent."""
        svc = self.service
        now = _now_ms()
        sent = 0
        for half in list(svc.pending.values()):
            if half.offset not in svc.pending:
                continue
            if not immune_too and now - half.store_timestamp < half.immunity_ms:
                continue
            if half.check_times >= self.check_max:
                self.park(half)
                continue
            conns = self.ctx.producers.connections(half.group)
            if half.user and self.ctx.guard is not None:
                # under access control, only producers of the user that sent the half
                conns = [c for c in conns if channel_user(c) == half.user]
            if not conns:
                continue
            record = self.store.look_message_by_offset(half.offset)
            if record is None:
                svc.forget(half, "its record is gone (retention)")
                continue
            n = self._next.get(half.group, 0)
            self._next[half.group] = n + 1
            conn = conns[n % len(conns)]
            check = CheckTransactionState(
                transaction_offset=half.offset,
                msg_id=half.msg_id,
                transaction_id=half.transaction_id,
                group=half.group,
                topic=half.topic,
                queue_id=half.queue_id,
                check_times=half.check_times + 1,
                broker_name=self.ctx.config.broker_name,
            )
            try:
                conn.send_oneway(check, record)
            except TxmqError as exc:
                log.debug("checking %s with %s failed: %s", half.msg_id, conn.name, exc)
                continue
            half.check_times += 1
            svc.dirty = True
            sent += 1
            tally = self.ctx.throughput.tally
            if tally is not None:
                tally.checked(half.group)
            log.info(
                "checking half message %s (transaction %s, group %s) with %s (check %d of %d)",
                half.msg_id,
                half.transaction_id or "-",
                half.group,
                conn.name,
                half.check_times,
                self.check_max,
            )
        self.checks_sent += sent
        return sent

    def park(self, half: PendingHalf) -> bool:
        """Copy an undecided half to the parked topic and stop checking it."""
        record = self.store.look_message_by_offset(half.offset)
        if record is None:
            self.service.forget(half, "its record is gone (retention)")
            return False
        msg = decode_record(record)
        props = dict(msg.all_properties)
        props[Prop.TRANSACTION_CHECK_TIMES] = str(half.check_times)
        props.pop(CQ_TAG_PROPERTY, None)
        r = self.store.put(
            topic=PARKED_TOPIC,
            queue_id=0,
            body=msg.body,
            properties=props,
            born_timestamp=msg.born_timestamp,
            sys_flag=msg.sys_flag,
            flag=msg.flag,
            prepared_transaction_offset=half.offset,
        )
        if not r.ok:
            if r.status is not PutStatus.DISK_FULL:  # that one is logged once, by the store
                log.error("parking %s failed: %s", half.msg_id, r.status.value)
            return False
        self.service.settle(half, PARKED)
        log.warning(
            "half message %s (transaction %s, group %s, topic %s) is still undecided after %d "
            "checks; parked in %s for an operator",
            half.msg_id,
            half.transaction_id or "-",
            half.group,
            half.topic,
            half.check_times,
            PARKED_TOPIC,
        )
        return True

    # -- listing --------------------------------------------------------------------------

    def list_transactions(self, req: GetTransactions, call: Call) -> TransactionList:
        self.service.check_ready()
        limit = min(max(req.max, 1), MAX_LIST)
        group = req.group
        now = _now_ms()
        if req.state == "decided":
            decided = [r for r in self.service.decided.values() if not group or r.group == group]
            decided.reverse()  # the order they were made in: of two in one millisecond, the
            decided.sort(key=lambda r: r.decided_timestamp, reverse=True)  # later comes first
            return TransactionList(transactions=[], decisions=decided[:limit])
        if req.state == "pending":
            rows = [
                p.row(now) for p in self.service.pending.values() if not group or p.group == group
            ]
        else:
            rows = self._parked(group, now)
        return TransactionList(transactions=rows[:limit])

    def _parked(self, group: str | None, now: int) -> list[TransactionRow]:
        return [
            half.row(now, parked_timestamp=copy.store_timestamp)
            for half, copy in self.service.parked().values()
            if not group or half.group == group
        ]

    # -- persistence ----------------------------------------------------------------------

    def snapshot(self, force: bool = False) -> Snapshot | None:
        """What to save, or None if nothing changed (or recovery has not run)."""
        svc = self.service
        if not svc.ready or not (svc.dirty or force):
            return None
        svc.dirty = False
        return svc.offsets_file(), self.store.commit_log_max_offset

    def _write(self, snap: Snapshot, wait_flush: bool = True) -> None:
        data, upto = snap
        if wait_flush and not self.store.flush_wait(upto, self.flush_timeout_s):
            self.service.dirty = True  # the op records are not on disk yet: next round
            return
        write_json_atomic(self.service.path, data)

    def write(self, snap: Snapshot | None) -> None:
        """Save a snapshot taken before the store was shut down (so it is flushed)."""
        if snap is not None:
            self._write(snap, wait_flush=False)
