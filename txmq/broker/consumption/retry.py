"""Consumer retries and the dead-letter queue (RocketMQ's ``consumerSendMsgBack``).

A consumer that failed a message sends it back by commit-log offset.  The broker stores a
copy in ``%RETRY%<group>`` after delay level ``3 + reconsume_times`` (or the level the
consumer asked for) through the schedule topic; once ``max_reconsume_times`` is used up, or
when the consumer asks for level -1, the copy goes to ``%DLQ%<group>`` instead.  Operators
list the DLQ and re-send messages from it to the retry topic (DLQ_LIST / DLQ_RESEND).

A dead-letter copy says why in its ``TXMQ_DLQ_REASON`` property (at most 1024 characters):
the consumer's reason for level -1 (a listener's ``DeadLetter``), else "max reconsume times
(N) used up" followed by the consumer's last error when it sent one.  Retry copies and
re-sent dead letters carry no reason.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack

from txmq.broker.delivery.schedule import ScheduleMessageService
from txmq.broker.state.context import BrokerContext
from txmq.broker.state.putting import WAITING_PROPS, put_or_raise
from txmq.broker.store import MAX_PROPERTIES_SIZE, GetStatus, PutResult
from txmq.protocol.codec import decode_record
from txmq.protocol.message import (
    MessageExt,
    Prop,
    clip_reason,
    dlq_topic,
    retry_topic,
    used_up_reason,
)
from txmq.protocol.rpc import Call
from txmq.protocol.wire import (
    ConsumerSendMsgBack,
    DlqList,
    DlqPage,
    DlqResend,
    DlqResent,
    SendBack,
    WithBody,
)
from txmq.protocol.wire.errors import BadRequest, MessageNotFound

__all__ = ["DEFAULT_MAX_RECONSUME_TIMES", "FIRST_RETRY_LEVEL", "RetryService"]

log = logging.getLogger("txmq.broker")

DEFAULT_MAX_RECONSUME_TIMES = 16
#: the delay level of a consumer's first retry; each retry waits one level more
FIRST_RETRY_LEVEL = 3
MAX_DLQ_LIST = 1024
_DROP = WAITING_PROPS | {Prop.DLQ_REASON}
#: the reason of a dead letter its consumer sent to the DLQ without saying why
ON_PURPOSE = "sent to the DLQ by its consumer"


class RetryService:
    """CONSUMER_SEND_MSG_BACK, DLQ_LIST and DLQ_RESEND."""

    def __init__(self, ctx: BrokerContext, schedule: ScheduleMessageService) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.topics = ctx.topics
        self.schedule = schedule

    def _ensure(self, topic: str) -> None:
        cfg = self.topics.get(topic)
        if cfg is None or not cfg.system:
            self.topics.create_or_update(topic, 1, system=True)

    def _put(
        self,
        msg: MessageExt,
        topic: str,
        queue_id: int,
        props: dict[str, str],
        *,
        reconsume_times: int,
        cq_tag_code: int | None = None,
    ) -> PutResult:
        return put_or_raise(
            self.store,
            topic=topic,
            queue_id=queue_id,
            body=msg.body,
            properties=props,
            born_timestamp=msg.born_timestamp,
            sys_flag=msg.sys_flag,
            flag=msg.flag,
            reconsume_times=reconsume_times,
            cq_tag_code=cq_tag_code,
        )

    # -- send back ------------------------------------------------------------------------

    def send_back(
        self, req: ConsumerSendMsgBack, call: Call
    ) -> SendBack | asyncio.Future[SendBack]:
        group, offset, delay_level = req.group, req.commit_log_offset, req.delay_level
        max_times, origin = req.max_reconsume_times, req.origin_msg_id
        record = self.store.look_message_by_offset(offset) if offset >= 0 else None
        if record is None:
            raise MessageNotFound(f"no message at commit-log offset {offset}")
        msg = decode_record(record)
        times = msg.reconsume_times + 1
        reason = ""
        if delay_level < 0:
            level, reason = -1, req.reason or ON_PURPOSE
        elif times > max_times:
            level, reason = -1, used_up_reason(max_times, req.reason)
        else:
            level = delay_level if delay_level > 0 else FIRST_RETRY_LEVEL + msg.reconsume_times
        answer, r = self.store_copy(
            msg, group, times=times, max_times=max_times, level=level, origin=origin, reason=reason
        )
        # under SYNC flush, answer once the copy is on disk (like a send)
        return self.ctx.acks.after_flush(r.end_offset, answer)

    def store_copy(
        self,
        msg: MessageExt,
        group: str,
        *,
        times: int,
        max_times: int,
        level: int,
        origin: str = "",
        reason: str = "",
    ) -> tuple[SendBack, PutResult]:
        """Store a copy of ``msg`` for ``group`` to consume again, with reconsume times
        ``times``: in ``%DLQ%<group>`` for ``level`` < 0, in ``%RETRY%<group>`` at once for
        0, else after delay level ``level`` (through the schedule topic).  A dead-letter copy
        keeps ``reason`` (default: its retries are used up when ``times`` > ``max_times``,
        else its consumer sent it).  Shared by :meth:`send_back` and the pop service
        (:mod:`txmq.broker.consumption.pop`)."""
        stored = self._store_copy(
            msg, group, times=times, max_times=max_times, level=level, origin=origin, reason=reason
        )
        tally = self.ctx.throughput.tally
        if tally is not None:
            tally.retried(group, dead=level < 0)
        return stored

    def _store_copy(
        self,
        msg: MessageExt,
        group: str,
        *,
        times: int,
        max_times: int,
        level: int,
        origin: str,
        reason: str,
    ) -> tuple[SendBack, PutResult]:
        props = {k: v for k, v in msg.all_properties.items() if k not in _DROP}
        props.setdefault(Prop.RETRY_TOPIC, msg.topic)
        props.setdefault(Prop.ORIGIN_MESSAGE_ID, origin or msg.msg_id)
        props[Prop.MAX_RECONSUME_TIMES] = str(max_times)
        if level < 0:
            target = dlq_topic(group)
            self._ensure(target)
            if not reason:
                reason = used_up_reason(max_times) if times > max_times else ON_PURPOSE
            props[Prop.DLQ_REASON] = clip_reason(reason)
            if len(msgpack.packb(props)) > MAX_PROPERTIES_SIZE:
                del props[Prop.DLQ_REASON]  # no room for it: the message matters more
            r = self._put(msg, target, 0, props, reconsume_times=times)
            self.ctx.arrivals.notify(target, 0)
            log.info(
                "message %s of group %s moved to %s after %d attempts: %r",
                msg.msg_id,
                group,
                target,
                times,
                props.get(Prop.DLQ_REASON, "-"),
            )
            return SendBack(topic=target, reconsume_times=times, delay_level=-1), r
        target = retry_topic(group)
        self._ensure(target)
        if level == 0:
            r = self._put(msg, target, 0, props, reconsume_times=times)
            self.ctx.arrivals.notify(target, 0)
            return SendBack(topic=target, reconsume_times=times, delay_level=0), r
        delayed = self.schedule.prepare(target, 0, props, level=level)
        assert delayed is not None
        topic, queue_id, stored, due, level = delayed
        r = self._put(msg, topic, queue_id, stored, reconsume_times=times, cq_tag_code=due)
        self.schedule.stored(level, due)
        return SendBack(topic=target, reconsume_times=times, delay_level=level), r

    # -- dead-letter queue ----------------------------------------------------------------

    def dlq_list(self, req: DlqList, call: Call) -> WithBody[DlqPage]:
        topic = dlq_topic(req.group)
        offset = max(req.offset, self.store.min_offset(topic, 0))
        max_msgs = min(max(req.max, 1), MAX_DLQ_LIST)
        got = self.store.get_messages(topic, 0, offset, max_msgs)
        page = DlqPage(
            next_offset=got.next_begin_offset if got.status is GetStatus.FOUND else offset,
            min_offset=self.store.min_offset(topic, 0),
            max_offset=self.store.max_offset(topic, 0),
        )
        return WithBody(page, b"".join(got.records))

    def dlq_resend(self, req: DlqResend, call: Call) -> DlqResent:
        group, resend_all = req.group, req.all
        if not resend_all and not req.msg_ids:
            raise BadRequest("DlqResend needs 'msg_ids' or 'all': true")
        wanted = set(req.msg_ids)
        found: set[str] = set()
        source = dlq_topic(group)
        target = retry_topic(group)
        offset = self.store.min_offset(source, 0)
        end = self.store.max_offset(source, 0)
        resent = 0
        while offset < end:
            got = self.store.get_messages(source, 0, offset, 256)
            if got.status is not GetStatus.FOUND:
                if got.next_begin_offset <= offset:
                    break
                offset = got.next_begin_offset
                continue
            for record in got.records:
                msg = decode_record(record)
                hit = {msg.msg_id, msg.offset_msg_id} & wanted
                if not resend_all and not hit:
                    continue
                found |= hit
                if resent == 0:
                    self._ensure(target)
                props = {k: v for k, v in msg.all_properties.items() if k not in _DROP}
                self._put(msg, target, 0, props, reconsume_times=0)
                resent += 1
            offset = got.next_begin_offset
        if resent:
            self.ctx.arrivals.notify(target, 0)
            log.info("re-sent %d message(s) from %s to %s", resent, source, target)
        return DlqResent(resent=resent, missing=sorted(wanted - found))
