"""Transactions an operator can finish: COMMIT or ROLLBACK a half message (pending, or
parked after the last check-back) with a reason, or RECHECK a parked one.

Every decision is a record in ``TXMQ_SYS_TRANS_DECISION`` (queue 0; its body a
:class:`txmq.protocol.wire.DecisionRow` as JSON), in the commit log like the halves themselves: it
survives restarts and is copied to slaves, and ``transactions --decided`` lists it.

Order of writes, so that a crash at any point neither loses a decision nor repeats one:

* COMMIT: the real message (``prepared_transaction_offset`` = the half's offset), then the
  decision, then the op record.  Before committing, the key index is asked for a committed
  copy of the half, so a decision repeated after a crash never stores the message twice.
* ROLLBACK: the decision, then the op record.  A pending half whose ROLLBACK decision has no
  op record yet is rolled back on the next start.
* RECHECK: a new copy of the half in the half topic (``TXMQ_RECHECK_OF`` = the parked half's
  offset, no check immunity, check count 0), then the decision, then an op record RECHECKED
  for the parked half.  The copy is an ordinary pending half: checked from the next round,
  parked again after the last check.

On start (after :meth:`TransactionService.recover`) the decisions are read back, and the
cuts a crash can leave are repaired: a pending half with a ROLLBACK decision is rolled back,
a COMMIT decision whose half is still pending is finished, a re-checked copy whose decision
is missing gets it, and a parked half whose committed copy exists gets its COMMIT decision.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from txmq.broker.state.context import BrokerContext
from txmq.broker.state.putting import put_or_raise
from txmq.broker.transactions.service import COMMIT, ROLLBACK, PendingHalf, TransactionService
from txmq.protocol.codec import decode_record
from txmq.protocol.message import DECISION_TOPIC, HALF_TOPIC, MessageExt, Prop, SysFlag
from txmq.protocol.rpc import Call
from txmq.protocol.wire import Decided, DecideTransaction, DecisionRow
from txmq.protocol.wire.errors import BadRequest, TransactionNotFound

__all__ = ["OperatorDecisions"]

log = logging.getLogger("txmq.broker.transaction")

RECHECK = "RECHECK"
#: the op record of a parked half an operator re-checked: its copy goes on in its place
RECHECKED = "RECHECKED"
#: the longest reason kept
REASON_MAX = 1024
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(DecisionRow).decode


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class OperatorDecisions:
    """Operators' decisions on half messages (see the module's text)."""

    def __init__(self, ctx: BrokerContext, service: TransactionService) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.service = service
        service.recovered.append(self.recover)

    # -- start-up -------------------------------------------------------------------------

    def recover(self) -> None:
        svc = self.service
        cfg = self.ctx.topics.get(DECISION_TOPIC)
        if cfg is None or not cfg.system:
            self.ctx.topics.create_or_update(DECISION_TOPIC, 1, system=True)
        svc.decided.clear()
        for msg in svc.scan(DECISION_TOPIC, 0):
            try:
                row = _decode(msg.body)
            except (msgspec.ValidationError, msgspec.DecodeError):
                log.warning("decision record at offset %d is malformed; ignored", msg.queue_offset)
                continue
            svc.decided[row.transaction_offset] = row
        repaired = 0
        for row in list(svc.decided.values()):
            half = svc.pending.get(row.transaction_offset)
            if half is None or row.decision == RECHECK:
                continue  # done (a RECHECK's copy is stored before its decision)
            # a COMMIT's op record, or a ROLLBACK's, was not written
            if row.decision == COMMIT and svc.committed_copy(half.offset, half.msg_id) is None:
                self._commit(half, svc.half_at(half.offset))
            svc.settle(half, row.decision)
            repaired += 1
        parked = self.service.parked()
        for half in list(svc.pending.values()):
            # a RECHECK's copy stored, its decision not
            if half.recheck_of in parked and half.recheck_of not in svc.decided:
                old = parked[half.recheck_of][0]
                self._record(self._recovered(old, RECHECK, recheck_offset=half.offset))
                repaired += 1
        for off, (half, _) in parked.items():
            # a COMMIT's message stored, its decision not
            if off not in svc.decided and svc.committed_copy(off, half.msg_id) is not None:
                self._record(self._recovered(half, COMMIT))
                svc.settle(half, COMMIT)
                repaired += 1
        if repaired:
            log.warning("transactions: %d operator decision(s) finished after a crash", repaired)

    def _recovered(
        self, half: PendingHalf, decision: str, *, recheck_offset: int | None = None
    ) -> DecisionRow:
        return self._row(half, decision, "parked", "recorded after a crash cut the decision",
                         "?", "", recheck_offset=recheck_offset)  # fmt: skip

    # -- requests -------------------------------------------------------------------------

    def decide(self, req: DecideTransaction, call: Call) -> Decided | asyncio.Future[Decided]:
        """Apply an operator's decision; answered once it is flushed (as a send is)."""
        svc = self.service
        svc.check_ready()
        decision = req.decision
        reason = req.reason.strip()[:REASON_MAX]
        if decision != RECHECK and not reason:
            raise BadRequest(f"{decision} by an operator needs a reason")
        if req.all:
            if decision != RECHECK:
                raise BadRequest("'all' is for RECHECK only: COMMIT and ROLLBACK name one half")
            targets = [
                (half, "parked", copy)
                for half, copy in self.service.parked().values()
                if req.group is None or half.group == req.group
            ]
        else:
            targets = [self._find(req)]
        rows = []
        end = 0
        for half, was, msg in targets:
            row = self._row(half, decision, was, reason, req.operator, call.conn.name)
            row, end = self._apply(half, msg, row)
            rows.append(row)
        return self.ctx.acks.after_flush(end, Decided(decisions=rows))

    def _find(self, req: DecideTransaction) -> tuple[PendingHalf, str, MessageExt]:
        """The half a request names, what it is ("pending" or "parked"), and the record
        that carries its body and properties."""
        svc = self.service
        msg_id = req.msg_id
        if req.transaction_offset is not None:
            offsets = [req.transaction_offset]
            msg = svc.half_at(req.transaction_offset, req.group)
            msg_id = msg.msg_id
            if req.msg_id and req.msg_id != msg.msg_id:
                raise TransactionNotFound(
                    f"the half message at commit-log offset {req.transaction_offset} is "
                    f"{msg.msg_id}, not {req.msg_id}"
                )
        elif req.msg_id:
            offsets = [
                m.commit_log_offset
                for m in map(decode_record, self.store.query_all_by_uniq_key(req.msg_id))
                if m.topic == HALF_TOPIC
                and SysFlag.transaction_value(m.sys_flag) == SysFlag.TRANSACTION_PREPARED_TYPE
                and (req.group is None or m.all_properties.get(Prop.PRODUCER_GROUP) == req.group)
            ]
            if not offsets:
                raise TransactionNotFound(f"no half message {req.msg_id} on this broker")
        else:
            raise BadRequest("say which half message: msg_id or transaction_offset")
        parked = self.service.parked()
        for offset in sorted(offsets, reverse=True):  # a re-checked half's newest copy first
            if offset in svc.pending:
                if req.decision == RECHECK:
                    raise BadRequest(
                        f"half message {svc.pending[offset].msg_id} is pending: it is checked "
                        "back already; RECHECK is for parked ones"
                    )
                return svc.pending[offset], "pending", svc.half_at(offset)
            if offset in parked:
                half, copy = parked[offset]
                return half, "parked", copy
        newest = max(offsets)  # a re-checked half: how its last copy was resolved
        resolution = svc.resolution_of(newest, msg_id)
        name = req.msg_id or f"at commit-log offset {newest}"
        raise TransactionNotFound(
            f"half message {name} is neither pending nor parked: it was resolved ({resolution})"
        )

    # -- applying -------------------------------------------------------------------------

    def _row(
        self,
        half: PendingHalf,
        decision: str,
        was: str,
        reason: str,
        operator: str,
        address: str,
        *,
        recheck_offset: int | None = None,
    ) -> DecisionRow:
        return DecisionRow(
            msg_id=half.msg_id,
            transaction_id=half.transaction_id,
            group=half.group,
            topic=half.topic,
            transaction_offset=half.offset,
            decision=decision,  # type: ignore[arg-type]
            was=was,  # type: ignore[arg-type]
            reason=reason,
            operator=operator or "?",
            address=address,
            decided_timestamp=_now_ms(),
            recheck_offset=recheck_offset,
        )

    def _apply(
        self, half: PendingHalf, msg: MessageExt, row: DecisionRow
    ) -> tuple[DecisionRow, int]:
        """Carry a decision out: the row as recorded, and the commit-log offset its last
        record ends at."""
        svc = self.service
        if row.decision == COMMIT:
            if svc.committed_copy(half.offset, half.msg_id) is None:
                self._commit(half, msg)
            end = self._record(row)
            op = svc.settle(half, COMMIT)
        elif row.decision == ROLLBACK:
            end = self._record(row)
            op = svc.settle(half, ROLLBACK)
        else:
            copy = self._recheck_copy(half, msg)
            row = msgspec.structs.replace(row, recheck_offset=copy)
            end = self._record(row)
            # the parked half is superseded by its copy (the reconciliation job reads this)
            op = svc.settle(half, RECHECKED)
        log.warning(
            "operator %s (from %s): %s half message %s (transaction %s, group %s, topic %s, "
            "%s)%s: %s",
            row.operator,
            row.address,
            row.decision,
            row.msg_id,
            row.transaction_id or "-",
            row.group,
            row.topic,
            row.was,
            f", new copy at offset {row.recheck_offset}" if row.recheck_offset is not None else "",
            row.reason or "no reason given",
        )
        return row, max(end, op.end_offset if op is not None else 0)

    def _commit(self, half: PendingHalf, msg: MessageExt) -> None:
        queue_id, _ = self.service.commit_message(half, msg)
        self.ctx.arrivals.notify(half.topic, queue_id)

    def _recheck_copy(self, half: PendingHalf, msg: MessageExt) -> int:
        """Store a new copy of a parked half to be checked again; its commit-log offset."""
        props = {
            k: v
            for k, v in msg.all_properties.items()
            if k not in (Prop.TRANSACTION_CHECK_TIMES, Prop.RECHECK_OF)
        }
        props[Prop.RECHECK_OF] = str(half.offset)
        props[Prop.CHECK_IMMUNITY_TIME_IN_SECONDS] = "0"
        return self.service.store_recheck(props, msg).offset

    def _record(self, row: DecisionRow) -> int:
        """Store a decision; the commit-log offset its record ends at."""
        r = put_or_raise(
            self.store,
            topic=DECISION_TOPIC,
            queue_id=0,
            body=_encode(row),
            properties={Prop.TAGS: row.decision, Prop.KEYS: row.msg_id},
            born_timestamp=row.decided_timestamp,
        )
        self.service.decided[row.transaction_offset] = row
        self.service.dirty = True
        return r.end_offset
