"""Transactional (half) messages: RocketMQ's ``TransactionalMessageService`` in miniature.

A SEND_MESSAGE whose TRAN_MSG property is ``"true"`` is a *half message*: it is stored in
``RMQ_SYS_TRANS_HALF_TOPIC`` (queue 0) with its real topic, queue and producer group in
REAL_TOPIC / REAL_QID / PGROUP and the PREPARED system flag, where no consumer of the real
topic sees it.  Its commit-log offset (``transaction_offset``) names the transaction from
then on.  END_TRANSACTION resolves it:

* COMMIT stores the real message (real topic and queue, the same UNIQ_KEY, the COMMIT flag,
  ``prepared_transaction_offset`` = the half's offset), then an *op record* in
  ``RMQ_SYS_TRANS_OP_HALF_TOPIC`` naming the half and the resolution;
* ROLLBACK stores the op record only; UNKNOWN changes nothing.

A half that stays undecided is checked back with a live producer of its group
(broker/transactions/check.py) and parked in ``TRANS_CHECK_MAX_TIME_TOPIC`` after the last
check (op record ``PARKED``).

Exactness.  The broker keeps the *pending* halves in memory; every other half in the store
is resolved.  On start the pending set is rebuilt from the half topic (from the persisted
check offset) minus the halves named by op records (from the persisted op offset).  A crash
between a COMMIT's real message and its op record (or a park's copy and its op record)
leaves a half that looks pending; recovery looks every pending half's UNIQ_KEY up in the
key index, and a record derived from it (``prepared_transaction_offset`` = the half's
offset: the committed message or the parked copy) means it was resolved: the missing op
record is written then.  So a COMMIT is never stored twice, across restarts too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

import msgspec

from txmq.broker.delivery.schedule import ScheduleMessageService
from txmq.broker.state.context import BrokerContext
from txmq.broker.state.putting import put_or_raise
from txmq.broker.store import CQ_TAG_PROPERTY, GetStatus, PutResult, PutStatus
from txmq.protocol.codec import decode_record
from txmq.protocol.message import (
    HALF_TOPIC,
    OP_TOPIC,
    PARKED_TOPIC,
    MessageExt,
    Prop,
    SysFlag,
    new_message_id,
)
from txmq.protocol.rpc import Call
from txmq.protocol.wire import DecisionRow, Ended, EndTransaction, SendMessage, Sent, TransactionRow
from txmq.protocol.wire.errors import BadRequest, BrokerBusy, DiskFull, TransactionNotFound
from txmq.security.acl.policy import topic_resource
from txmq.server.jsonfile import load_json

__all__ = [
    "COMMIT",
    "PARKED",
    "ROLLBACK",
    "PendingHalf",
    "TransactionOffsetsFile",
    "TransactionService",
    "parse_op",
]

log = logging.getLogger("txmq.broker.transaction")

COMMIT, ROLLBACK, UNKNOWN, PARKED = "COMMIT", "ROLLBACK", "UNKNOWN", "PARKED"
#: properties of a half that the committed message does not carry
_DROP = frozenset(
    {
        Prop.TRAN_MSG,
        Prop.REAL_TOPIC,
        Prop.REAL_QID,
        Prop.PRODUCER_GROUP,
        Prop.ACL_USER,
        Prop.TRANSACTION_CHECK_TIMES,
        Prop.CHECK_IMMUNITY_TIME_IN_SECONDS,
        Prop.RECHECK_OF,
        CQ_TAG_PROPERTY,
    }
)
#: a resolution as the metrics name it
_SETTLED = {COMMIT: "committed", ROLLBACK: "rolled_back", PARKED: "parked"}
_RESOLVED_CACHE = 65536
_SCAN_BATCH = 256


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


_Offset = Annotated[int, msgspec.Meta(ge=0)]


class TransactionOffsetsFile(msgspec.Struct):
    """``transaction_offsets.json``: where the check rounds resume (written by
    :class:`txmq.broker.transactions.check.TransactionChecker`)."""

    check_offset: _Offset = 0
    op_offset: _Offset = 0
    #: half's commit-log offset -> checks so far
    check_times: dict[_Offset, _Offset] = {}


@dataclass(slots=True)
class PendingHalf:
    """A half message not resolved yet."""

    offset: int  # commit-log offset of the half record: the transaction's identity
    queue_offset: int  # in the half topic
    msg_id: str
    transaction_id: str
    group: str
    topic: str
    queue_id: int
    born_timestamp: int
    store_timestamp: int
    immunity_ms: int
    #: the op topic's max offset when the half was stored: its op record comes later
    op_mark: int
    check_times: int = 0
    #: a re-checked half's copy: the offset of the parked half it copies (else -1)
    recheck_of: int = -1
    #: who sent it (access control on; else ""): only that user's producers are asked
    user: str = ""

    def row(self, now_ms: int, *, parked_timestamp: int | None = None) -> TransactionRow:
        return TransactionRow(
            msg_id=self.msg_id,
            transaction_id=self.transaction_id,
            group=self.group,
            topic=self.topic,
            queue_id=self.queue_id,
            transaction_offset=self.offset,
            born_timestamp=self.born_timestamp,
            check_times=self.check_times,
            age_s=round(max(now_ms - self.born_timestamp, 0) / 1000, 1),
            parked_timestamp=parked_timestamp,
        )


def _immunity_ms(props: dict[str, str], default_s: float) -> int:
    raw = props.get(Prop.CHECK_IMMUNITY_TIME_IN_SECONDS)
    if raw is None:
        return round(default_s * 1000)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise BadRequest(
            f"{Prop.CHECK_IMMUNITY_TIME_IN_SECONDS} must be a number of seconds, not {raw!r}"
        )
    return round(seconds * 1000)


def parse_op(body: bytes) -> tuple[int, str] | None:
    """(half offset, resolution) of an op record's body, or None if it is not one."""
    try:
        data = json.loads(body)
        return int(data["half_offset"]), str(data["resolution"])
    except (ValueError, KeyError, TypeError):
        return None


class TransactionService:
    """Half messages, their resolution and the pending set (checks: ``TransactionChecker``)."""

    def __init__(self, ctx: BrokerContext, schedule: ScheduleMessageService) -> None:
        """``schedule``: where a committed message that carries a delay or a delivery time
        waits for it."""
        self.ctx = ctx
        self.schedule = schedule
        self.config = ctx.config
        self.store = ctx.store
        self.topics = ctx.topics
        self.path = ctx.config.store / "config" / "transaction_offsets.json"
        #: pending halves by commit-log offset, in store order
        self.pending: dict[int, PendingHalf] = {}
        self._resolved: OrderedDict[int, str] = OrderedDict()
        #: operators' decisions by the half's offset (broker/transactions/operator.py)
        self.decided: dict[int, DecisionRow] = {}
        #: called at the end of :meth:`recover`
        self.recovered: list[Callable[[], None]] = []
        self.dirty = False
        self.ready = False

    # -- start-up -------------------------------------------------------------------------

    def recover(self) -> None:
        """Rebuild the pending set from the store (the broker calls it once it is open, and
        again when it becomes its broker set's master)."""
        self.pending = {}
        self._resolved.clear()
        self.ready = False
        saved = load_json(self.path, TransactionOffsetsFile)
        check_offset, op_offset, counts = saved.check_offset, saved.op_offset, saved.check_times
        for topic in (HALF_TOPIC, OP_TOPIC, PARKED_TOPIC):
            cfg = self.topics.get(topic)
            if cfg is None or not cfg.system:
                self.topics.create_or_update(topic, 1, system=True)
        resolved: dict[int, str] = {}
        for msg in self.scan(OP_TOPIC, op_offset):
            op = parse_op(msg.body)
            if op is not None:
                resolved[op[0]] = op[1]
                self._remember(*op)
        for msg in self.scan(HALF_TOPIC, check_offset):
            if SysFlag.transaction_value(msg.sys_flag) != SysFlag.TRANSACTION_PREPARED_TYPE:
                continue
            off = msg.commit_log_offset
            if off in resolved:
                continue
            half = self.half_of(msg, op_mark=op_offset, check_times=counts.get(off, 0))
            if half is not None:
                self.pending[off] = half
        repaired = 0
        for half in list(self.pending.values()):
            kind = self._derived_resolution(half.offset, half.msg_id)
            if kind is not None:
                log.warning(
                    "half message %s (offset %d) was %s before a crash but its op record is "
                    "missing; writing it now",
                    half.msg_id,
                    half.offset,
                    kind,
                )
                self.settle(half, kind)
                repaired += 1
        self.ready = True
        self.dirty = True
        for then in self.recovered:
            then()
        log.info(
            "transactions: %d pending half message(s) (check offset %d, op offset %d, "
            "%d op record(s) repaired)",
            len(self.pending),
            check_offset,
            op_offset,
            repaired,
        )

    def scan(self, topic: str, offset: int) -> Iterator[MessageExt]:
        end = self.store.max_offset(topic, 0)
        offset = max(offset, self.store.min_offset(topic, 0))
        while offset < end:
            got = self.store.get_messages(topic, 0, offset, _SCAN_BATCH)
            if got.status is GetStatus.FOUND:
                for record in got.records:
                    yield decode_record(record)
            if got.next_begin_offset <= offset:
                break
            offset = got.next_begin_offset

    def half_of(
        self, msg: MessageExt, *, offset: int | None = None, op_mark: int = 0, check_times: int = 0
    ) -> PendingHalf | None:
        """The :class:`PendingHalf` of a half message's record (or of its parked copy, with
        the half's ``offset``); None if it is malformed."""
        props = msg.all_properties
        try:
            queue_id = int(props.get(Prop.REAL_QID, ""))
            immunity = _immunity_ms(props, self.config.transaction_timeout_s)
            recheck_of = int(props.get(Prop.RECHECK_OF, "-1"))
        except (ValueError, BadRequest):
            log.warning("half message at offset %d is malformed; ignored", msg.commit_log_offset)
            return None
        return PendingHalf(
            offset=msg.commit_log_offset if offset is None else offset,
            queue_offset=msg.queue_offset if offset is None else -1,
            msg_id=msg.msg_id,
            transaction_id=props.get(Prop.TRANSACTION_ID, ""),
            group=props.get(Prop.PRODUCER_GROUP, ""),
            topic=props.get(Prop.REAL_TOPIC, ""),
            queue_id=queue_id,
            born_timestamp=msg.born_timestamp,
            store_timestamp=msg.store_timestamp,
            immunity_ms=immunity,
            op_mark=op_mark,
            check_times=check_times,
            recheck_of=recheck_of,
            user=props.get(Prop.ACL_USER, ""),
        )

    def _derived(self, offset: int, msg_id: str) -> Iterator[MessageExt]:
        """The records derived from the half at ``offset``: its committed message, its
        parked copy."""
        for record in self.store.query_all_by_uniq_key(msg_id):
            msg = decode_record(record)
            if msg.commit_log_offset != offset and msg.prepared_transaction_offset == offset:
                yield msg

    def parked(self) -> dict[int, tuple[PendingHalf, MessageExt]]:
        """The parked halves no operator has decided yet, by the half's offset, oldest
        first: each with its parked copy (which carries the half's body and properties,
        and its check count)."""
        found: dict[int, tuple[PendingHalf, MessageExt]] = {}
        for copy in self.scan(PARKED_TOPIC, 0):
            off = copy.prepared_transaction_offset
            if off in self.decided:
                continue  # an operator committed, rolled back or re-checked it
            try:
                times = int(copy.all_properties.get(Prop.TRANSACTION_CHECK_TIMES, "0"))
            except ValueError:
                times = 0
            half = self.half_of(copy, offset=off, check_times=times)
            if half is not None:
                found[off] = (half, copy)
        return found

    def committed_copy(self, offset: int, msg_id: str) -> MessageExt | None:
        """The committed message of the half at ``offset``, if the store holds one."""
        for msg in self._derived(offset, msg_id):
            if SysFlag.transaction_value(msg.sys_flag) == SysFlag.TRANSACTION_COMMIT_TYPE:
                return msg
        return None

    def _derived_resolution(self, offset: int, msg_id: str) -> str | None:
        """COMMIT / PARKED if the store holds the committed message / parked copy of a half
        (COMMIT when both: an operator committed a parked half)."""
        found = None
        for msg in self._derived(offset, msg_id):
            if SysFlag.transaction_value(msg.sys_flag) == SysFlag.TRANSACTION_COMMIT_TYPE:
                return COMMIT
            if msg.topic == PARKED_TOPIC:
                found = PARKED
        return found

    # -- bookkeeping ----------------------------------------------------------------------

    def _remember(self, offset: int, resolution: str) -> None:
        self._resolved[offset] = resolution
        if len(self._resolved) > _RESOLVED_CACHE:
            self._resolved.popitem(last=False)

    def resolution_of(self, offset: int, msg_id: str) -> str:
        """How a half that is no longer pending was resolved."""
        decided = self.decided.get(offset)
        if decided is not None:
            return "RECHECKED" if decided.decision == "RECHECK" else decided.decision
        known = self._resolved.get(offset)
        if known is not None:
            return known
        # older than the cache: a committed message or parked copy says so; else rolled back
        return self._derived_resolution(offset, msg_id) or ROLLBACK

    def offsets_file(self) -> TransactionOffsetsFile:
        """Where check rounds resume, as ``transaction_offsets.json`` holds it."""
        check_offset, op_offset = self.offsets()
        return TransactionOffsetsFile(
            check_offset=check_offset,
            op_offset=op_offset,
            check_times={h.offset: h.check_times for h in self.pending.values() if h.check_times},
        )

    def offsets(self) -> tuple[int, int]:
        """(check offset, op offset) to persist: the oldest pending half and its op mark."""
        for half in self.pending.values():
            return half.queue_offset, half.op_mark
        return self.store.max_offset(HALF_TOPIC, 0), self.store.max_offset(OP_TOPIC, 0)

    def settle(self, half: PendingHalf, resolution: str) -> PutResult | None:
        """Write the op record of a half and mark it resolved; None if the write failed.

        A failed ROLLBACK changes nothing (the half stays pending).  After a COMMIT's real
        message or a park's copy is stored the half is resolved even if its op record could
        not be written: recovery finds the derived record and writes the op record then.
        """
        body = json.dumps(
            {
                "half_offset": half.offset,
                "half_queue_offset": half.queue_offset,
                "resolution": resolution,
                "msg_id": half.msg_id,
                "transaction_id": half.transaction_id,
                "group": half.group,
                "topic": half.topic,
            },
            separators=(",", ":"),
        ).encode()
        r = self.store.put(
            topic=OP_TOPIC,
            queue_id=0,
            body=body,
            properties={Prop.TAGS: resolution},
            born_timestamp=_now_ms(),
        )
        if not r.ok:
            if r.status is not PutStatus.DISK_FULL:  # that one is logged once, by the store
                log.error("writing the %s op record of %s failed: %s", resolution, half.msg_id, r)
            if resolution == ROLLBACK:
                return None
        self.pending.pop(half.offset, None)
        self._remember(half.offset, resolution)
        self.dirty = True
        tally = self.ctx.throughput.tally
        if tally is not None:
            tally.half(half.group, _SETTLED.get(resolution, resolution.lower()))
        return r if r.ok else None

    # -- requests -------------------------------------------------------------------------

    def check_ready(self) -> None:
        if not self.ready:
            raise BrokerBusy("the broker is still recovering transactions; try again")

    def prepare(self, req: SendMessage, body: bytes) -> Sent | asyncio.Future[Sent]:
        """Store a half message (its topic and queue already checked by the caller)."""
        self.check_ready()
        group, topic, queue_id, props = req.group, req.topic, req.queue_id, req.properties
        if not group:
            raise BadRequest("SendMessage: a half message needs header field 'group'")
        if Prop.DELIVER_AT in props:
            self.schedule.deliver_at(props)  # a delivery time that is one, and not too far
        if Prop.DELAY in props:
            self.schedule.level_of(props)
        stored = {
            k: v
            for k, v in props.items()
            if k not in (Prop.TRANSACTION_CHECK_TIMES, Prop.RECHECK_OF)
        }
        stored.setdefault(Prop.UNIQ_KEY, new_message_id())
        stored[Prop.TRAN_MSG] = "true"
        stored[Prop.REAL_TOPIC] = topic
        stored[Prop.REAL_QID] = str(queue_id)
        stored[Prop.PRODUCER_GROUP] = group
        half, r = self._store_half(stored, body, req.born_timestamp or _now_ms(), req.flag)
        answer = Sent(
            msg_id=half.msg_id,
            offset_msg_id=f"{r.commit_log_offset:016X}",
            queue_id=queue_id,
            queue_offset=r.queue_offset,
            store_timestamp=r.store_timestamp,
            transaction_offset=r.commit_log_offset,
        )
        return self.ctx.acks.after_flush(r.end_offset, answer)

    def _store_half(
        self, props: dict[str, str], body: bytes, born: int, flag: int
    ) -> tuple[PendingHalf, PutResult]:
        """Store a half message (its properties complete) and add it to the pending set."""
        immunity = _immunity_ms(props, self.config.transaction_timeout_s)
        op_mark = self.store.max_offset(OP_TOPIC, 0)
        r = put_or_raise(
            self.store,
            topic=HALF_TOPIC,
            queue_id=0,
            body=body,
            properties=props,
            born_timestamp=born,
            sys_flag=SysFlag.TRANSACTION_PREPARED_TYPE,
            flag=flag,
        )
        half = PendingHalf(
            offset=r.commit_log_offset,
            queue_offset=r.queue_offset,
            msg_id=props[Prop.UNIQ_KEY],
            transaction_id=props.get(Prop.TRANSACTION_ID, ""),
            group=props[Prop.PRODUCER_GROUP],
            topic=props[Prop.REAL_TOPIC],
            queue_id=int(props[Prop.REAL_QID]),
            born_timestamp=born,
            store_timestamp=r.store_timestamp,
            immunity_ms=immunity,
            op_mark=op_mark,
            recheck_of=int(props.get(Prop.RECHECK_OF, "-1")),
            user=props.get(Prop.ACL_USER, ""),
        )
        self.pending[half.offset] = half
        tally = self.ctx.throughput.tally
        if tally is not None:
            tally.half(half.group, "prepared")
        return half, r

    def store_recheck(self, props: dict[str, str], msg: MessageExt) -> PendingHalf:
        """Store a parked half's copy (``props`` naming it in RECHECK_OF) to be checked
        back again from the next round."""
        half, _ = self._store_half(props, msg.body, msg.born_timestamp, msg.flag)
        return half

    def half_at(self, offset: int, group: str | None = None) -> MessageExt:
        """The half message at ``offset`` (of ``group``), or TransactionNotFound."""
        record = self.store.look_message_by_offset(offset) if offset >= 0 else None
        if record is None:
            raise TransactionNotFound(f"no half message at commit-log offset {offset}")
        msg = decode_record(record)
        prepared = SysFlag.transaction_value(msg.sys_flag) == SysFlag.TRANSACTION_PREPARED_TYPE
        if msg.topic != HALF_TOPIC or not prepared:
            raise TransactionNotFound(
                f"the record at commit-log offset {offset} ({msg.topic}) is not a half message"
            )
        owner = msg.all_properties.get(Prop.PRODUCER_GROUP, "")
        if group is not None and owner != group:
            raise TransactionNotFound(
                f"the half message at commit-log offset {offset} belongs to producer group "
                f"{owner!r}, not {group!r}"
            )
        return msg

    def end_transaction(
        self, req: EndTransaction, call: Call | None = None
    ) -> Ended | asyncio.Future[Ended]:
        self.check_ready()
        group, offset, state, msg_id = req.group, req.transaction_offset, req.state, req.msg_id
        msg = self.half_at(offset, group)
        if msg_id and msg_id != msg.msg_id:
            raise TransactionNotFound(
                f"the half message at commit-log offset {offset} is {msg.msg_id}, not {msg_id}"
            )
        if call is not None and call.user is not None:
            self._may_end(msg, call)
        tally = self.ctx.throughput.tally
        if tally is not None and req.from_check:
            tally.check_answer(group, state)
        half = self.pending.get(offset)
        if half is None:
            resolution = self.resolution_of(offset, msg.msg_id)
            log.info(
                "END %s for %s (offset %d, group %s%s): already resolved (%s)",
                state,
                msg.msg_id,
                offset,
                group,
                ", from a check" if req.from_check else "",
                resolution,
            )
            return Ended(result="ALREADY_RESOLVED", resolution=resolution)
        if state == UNKNOWN:
            log.debug("END UNKNOWN for %s (offset %d)", msg.msg_id, offset)
            return Ended(result="UNKNOWN")
        if state == COMMIT:
            queue_id, r = self.commit_message(half, msg)
            answer = Ended(
                result="COMMITTED",
                queue_id=queue_id,
                queue_offset=r.queue_offset,
                offset_msg_id=f"{r.commit_log_offset:016X}",
            )
            end = r.end_offset
            op = self.settle(half, COMMIT)
            self.ctx.arrivals.notify(half.topic, queue_id)
        else:
            answer = Ended(result="ROLLED_BACK")
            end = 0
            op = self.settle(half, ROLLBACK)
            if op is None:
                if self.store.disk.full:
                    raise DiskFull(self.store.disk.reason or "the broker's disk is full")
                raise BrokerBusy("the broker could not store the rollback; try again")
        if op is not None:
            end = op.end_offset
        log.debug("END %s for %s (offset %d, group %s)", state, msg.msg_id, offset, group)
        if call is not None and call.oneway:
            # nobody waits for this answer (RocketMQ's endTransactionOneway, what the
            # producer sends after its local transaction): no flush is asked for it.  Under
            # SYNC flush the next group commit (or the flush interval) takes it to disk; a
            # machine crash before that may lose the commit and its op record, and the
            # check-back settles the half again, as after a lost request (the message keeps
            # its id, which consumers deduplicate on)
            return answer
        return self.ctx.acks.after_flush(end, answer)

    def _may_end(self, msg: MessageExt, call: Call) -> None:
        """Under access control, a half is ended by the user who sent it (with ``pub`` on
        its topic still), or by a super user."""
        user, guard = call.user, self.ctx.guard
        if user is None or guard is None or user.super_user:
            return
        props = msg.all_properties
        sender = props.get(Prop.ACL_USER, "")
        if sender and sender != user.name:
            guard.refuse(
                call.conn,
                f"EndTransaction: half message {msg.msg_id} was sent by user {sender!r}; "
                f"{user.name!r} may not end it",
            )
        topic = props.get(Prop.REAL_TOPIC, "")
        guard.require(user, "pub", topic_resource(topic), "EndTransaction", call.conn)

    def commit_message(self, half: PendingHalf, msg: MessageExt) -> tuple[int, PutResult]:
        """Store the real message of a half: (queue id, result); raises if refused."""
        cfg = self.topics.for_send(half.topic)
        queue_id = half.queue_id % cfg.queue_nums
        props = {k: v for k, v in msg.all_properties.items() if k not in _DROP}
        # a delay or a delivery time counts from now: the message waits for it from its
        # commit (its delivery time, when that has come already, is now)
        delayed = self.schedule.destination(half.topic, queue_id, props)
        r = put_or_raise(
            self.store,
            topic=half.topic if delayed is None else delayed[0],
            queue_id=queue_id if delayed is None else delayed[1],
            body=msg.body,
            properties=props if delayed is None else delayed[2],
            born_timestamp=msg.born_timestamp,
            sys_flag=(msg.sys_flag & ~SysFlag.TRANSACTION_MASK) | SysFlag.TRANSACTION_COMMIT_TYPE,
            flag=msg.flag,
            prepared_transaction_offset=half.offset,
            cq_tag_code=None if delayed is None else delayed[3],
        )
        if delayed is not None:
            self.schedule.stored(delayed[4], delayed[3])
        tally = self.ctx.throughput.tally
        if tally is not None:
            tally.stored(half.topic, "transaction", len(msg.body))
        return queue_id, r

    def forget(self, half: PendingHalf, why: str) -> None:
        self.pending.pop(half.offset, None)
        self.dirty = True
        log.warning("half message %s (offset %d) dropped: %s", half.msg_id, half.offset, why)
