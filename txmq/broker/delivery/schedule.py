"""Delayed delivery by level (RocketMQ's ``ScheduleMessageService``), and at an exact time.

A message sent with the DELAY property (level 1..N of ``message_delay_levels``; a higher
level is clamped to N) is stored in ``SCHEDULE_TOPIC_XXXX``, queue ``level - 1``, with its
real topic and queue in REAL_TOPIC / REAL_QID and its delivery time (ms) as the
consume-queue tag code.  One task per level reads that queue in order (every message of a
level has the same delay, so the queue is sorted by delivery time): it delivers what is due
into the real topic, then sleeps until the head is due or a new message arrives in an empty
level.  Consumer retries take the same path into ``%RETRY%<group>``.

A message to deliver at an exact time (DELIVER_AT, milliseconds since the epoch: what a
RocketMQ 5 client's delivery timestamp becomes) is a timer message: :mod:`broker.timer`
(this service owns it as ``timer``, runs it and persists it).  A message of an older
version still waiting in a level with DELIVER_AT goes on to the timer when the level
delivers it.

The read offset of each level is saved in ``<store>/config/delay_offsets.json`` every few
seconds and at shutdown.  After a crash the saved offsets may lag behind: the messages
delivered since are delivered again (at least once, never lost).
"""

from __future__ import annotations

import logging
from typing import Annotated

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from txmq.broker.delivery.timer import TimerService
from txmq.broker.state.context import BrokerContext
from txmq.broker.state.persisting import SavedState
from txmq.broker.state.putting import WAITING_PROPS, real_destination
from txmq.broker.store import CQ_TAG_PROPERTY, GetStatus, PutStatus
from txmq.protocol.codec import decode_record
from txmq.protocol.message import SCHEDULE_TOPIC, MessageExt, Prop
from txmq.protocol.wire.errors import BadRequest, MessageTooLarge
from txmq.server.jsonfile import load_json

__all__ = ["DelayOffsetsFile", "Delayed", "ScheduleMessageService"]

log = logging.getLogger("txmq.broker.schedule")

_BATCH = 64

#: where a delayed message is stored instead: (topic, queue id, properties, delivery ms,
#: level; 0 for a timer message)
Delayed = tuple[str, int, dict[str, str], int, int]


def _deliver_at(msg: MessageExt) -> int | None:
    raw = msg.all_properties.get(Prop.DELIVER_AT)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


class DelayOffsetsFile(msgspec.Struct):
    """``delay_offsets.json``: delay level -> the next offset of its schedule queue."""

    offsets: dict[Annotated[int, msgspec.Meta(ge=1)], Annotated[int, msgspec.Meta(ge=0)]] = {}


class ScheduleMessageService(SavedState):
    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.levels: tuple[int, ...] = ctx.config.delay_levels
        self.persist_interval_s = ctx.config.offset_persist_interval_s
        self.path = ctx.config.store / "config" / "delay_offsets.json"
        self.what = "delay-level offsets"
        self._offsets: dict[int, int] = load_json(self.path, DelayOffsetsFile).offsets
        self._dirty = False
        self._wake: dict[int, anyio.Event] = {}
        self._next_due: dict[int, int | None] = {}
        #: timer messages (exact delivery times)
        self.timer = TimerService(ctx)
        ctx.clock.on_advance.append(self._advanced)

    # -- the send side --------------------------------------------------------------------

    @property
    def max_level(self) -> int:
        return len(self.levels)

    def delay_ms(self, level: int) -> int:
        return self.levels[min(max(level, 1), len(self.levels)) - 1]

    def level_of(self, props: dict[str, str]) -> int:
        """The (clamped) delay level a message asks for; 0 if none."""
        raw = props.get(Prop.DELAY)
        if raw is None:
            return 0
        try:
            level = int(raw)
        except ValueError:
            raise BadRequest(f"DELAY property {raw!r} is not a delay level number") from None
        return min(level, self.max_level) if level > 0 else 0

    def prepare(
        self, topic: str, queue_id: int, props: dict[str, str], level: int | None = None
    ) -> Delayed | None:
        """Where to store a message for delayed delivery, or None if it is not delayed.

        ``level`` overrides the DELAY property (consumer retries).
        """
        if level is None:
            level = self.level_of(props)
        else:
            level = min(level, self.max_level)
        if level <= 0:
            return None
        due = self.ctx.clock.now_ms() + self.delay_ms(level)
        stored = {k: v for k, v in props.items() if k != CQ_TAG_PROPERTY}
        stored[Prop.DELAY] = str(level)
        stored[Prop.REAL_TOPIC] = topic
        stored[Prop.REAL_QID] = str(queue_id)
        return SCHEDULE_TOPIC, level - 1, stored, due, level

    def destination(self, topic: str, queue_id: int, props: dict[str, str]) -> Delayed | None:
        """Where a message with DELIVER_AT or DELAY is stored to wait (None: it is not
        delayed, or already due); raises BadRequest for a delivery time that is not one or
        is more than ``timer_max_delay_s`` ahead."""
        if Prop.DELIVER_AT in props:
            return self.prepare_at(topic, queue_id, props, self.deliver_at(props))
        if Prop.DELAY in props:
            return self.prepare(topic, queue_id, props)
        return None

    def deliver_at(self, props: dict[str, str]) -> int:
        """A message's DELIVER_AT (ms since the epoch), checked."""
        raw = props[Prop.DELIVER_AT]
        try:
            at = int(raw)
        except ValueError:
            raise BadRequest(f"{Prop.DELIVER_AT} {raw!r} is not a time in ms") from None
        horizon = self.timer.max_delay_ms
        if at > self.ctx.clock.now_ms() + horizon:
            raise BadRequest(
                f"delivery time {at} is more than timer_max_delay_s ({horizon // 1000} s) ahead"
            )
        return at

    def prepare_at(
        self, topic: str, queue_id: int, props: dict[str, str], deliver_at_ms: int
    ) -> Delayed | None:
        """Where to store a message to deliver at ``deliver_at_ms`` (None: it is due): the
        timer topic (level 0)."""
        timer = self.timer.prepare(topic, queue_id, props, deliver_at_ms)
        return None if timer is None else (*timer, 0)

    def stored(self, level: int, due_ms: int) -> None:
        """A delayed message was stored: wake the level's task if it is due sooner."""
        if level == 0:
            self.timer.stored(due_ms)
            return
        nxt = self._next_due.get(level)
        if nxt is None or due_ms < nxt:
            self._next_due[level] = due_ms
            event = self._wake.get(level)
            if event is not None:
                event.set()

    # -- the delivery side ----------------------------------------------------------------

    def _levels_to_run(self) -> list[int]:
        existing = {
            qid + 1 for qid in self.store.queue_offsets().get(SCHEDULE_TOPIC, {}) if qid >= 0
        }
        return sorted(existing | set(range(1, self.max_level + 1)) | set(self._offsets))

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Deliver delayed messages until cancelled (the broker's task group)."""
        cfg = self.ctx.topics.get(SCHEDULE_TOPIC)
        levels = self._levels_to_run()
        if cfg is None or cfg.queue_nums < max(levels):
            self.ctx.topics.create_or_update(SCHEDULE_TOPIC, max(levels), system=True)
        async with anyio.create_task_group() as tg:
            for level in levels:
                self._wake[level] = anyio.Event()
                tg.start_soon(self._level_loop, level)
            tg.start_soon(self._persist_loop)
            await tg.start(self.timer.run)
            task_status.started()

    def _advanced(self) -> None:
        """The clock moved forward: every level looks at what is due now."""
        for event in self._wake.values():
            event.set()

    async def _level_loop(self, level: int) -> None:
        while True:
            self._wake[level] = event = anyio.Event()
            # what is stored while delivering (an exact time's next hop, maybe into this
            # very level) must wake this loop: nothing is due "sooner" than unknown
            self._next_due[level] = None
            due = self._deliver_due(level)
            if due == 0:  # more to do right away (a full batch, or an offset moved)
                await anyio.lowlevel.checkpoint()
                continue
            self._next_due[level] = due
            timeout = max((due - self.ctx.clock.now_ms()) / 1000, 0) if due is not None else None
            if timeout is None:
                await event.wait()
            else:
                with anyio.move_on_after(timeout):
                    await event.wait()

    def _deliver_due(self, level: int) -> int | None:
        """Deliver what is due; the next delivery time, None if idle, 0 to go on at once."""
        queue_id = level - 1
        offset = self._offsets.get(level, 0)
        got = self.store.get_messages(SCHEDULE_TOPIC, queue_id, offset, _BATCH)
        if got.status is not GetStatus.FOUND:
            if got.next_begin_offset != offset and got.status in (
                GetStatus.OFFSET_TOO_SMALL,
                GetStatus.OFFSET_OVERFLOW_BADLY,
                GetStatus.OFFSET_FOUND_NULL,
                GetStatus.NO_MATCHED_MESSAGE,
            ):
                log.warning(
                    "delay level %d: offset %d not readable (%s); moving to %d",
                    level,
                    offset,
                    got.status.value,
                    got.next_begin_offset,
                )
                self._set_offset(level, got.next_begin_offset)
                return 0
            return None
        now = self.ctx.clock.now_ms()
        for record in got.records:
            msg = decode_record(record)
            due = self._due_time(msg, level, now)
            if due > now:
                self._set_offset(level, msg.queue_offset)
                return due
            if not self._deliver(msg, level):
                self._set_offset(level, msg.queue_offset)
                # the store refused (shutting down): retry later
                return self.ctx.clock.now_ms() + 1000
            self._set_offset(level, msg.queue_offset + 1)
        return 0 if got.next_begin_offset < got.max_offset else None

    def _due_time(self, msg: MessageExt, level: int, now: int) -> int:
        raw = msg.all_properties.get(CQ_TAG_PROPERTY)
        delay = self.delay_ms(level)
        try:
            due = int(raw) if raw is not None else msg.store_timestamp + delay
        except ValueError:
            due = msg.store_timestamp + delay
        # the levels may have been shortened since: never wait longer than the current delay
        return min(due, now + delay)

    def _set_offset(self, level: int, offset: int) -> None:
        if self._offsets.get(level) != offset:
            self._offsets[level] = offset
            self._dirty = True

    def _deliver(self, msg: MessageExt, level: int) -> bool:
        """Store the real message; False if the store is not available or the disk is full
        (try again later)."""
        props = msg.all_properties
        where = real_destination(self.ctx.topics, msg, f"delay level {level}")
        if where is None:
            return True
        topic, queue_id = where
        at = _deliver_at(msg)
        hop = None
        if at is not None:  # an older version's exact time: the rest of it on the timer
            hop = self.prepare_at(
                topic, queue_id, {k: v for k, v in props.items() if k != Prop.DELAY}, at
            )
        try:
            if hop is not None:
                r = self.store.put(
                    topic=hop[0],
                    queue_id=hop[1],
                    body=msg.body,
                    properties=hop[2],
                    born_timestamp=msg.born_timestamp,
                    sys_flag=msg.sys_flag,
                    flag=msg.flag,
                    reconsume_times=msg.reconsume_times,
                    cq_tag_code=hop[3],
                )
            else:
                r = self.store.put(
                    topic=topic,
                    queue_id=queue_id,
                    body=msg.body,
                    properties={k: v for k, v in props.items() if k not in WAITING_PROPS},
                    born_timestamp=msg.born_timestamp,
                    sys_flag=msg.sys_flag,
                    flag=msg.flag,
                    reconsume_times=msg.reconsume_times,
                )
        except MessageTooLarge as exc:
            log.warning("delayed message %s for %s dropped: %s", msg.msg_id, topic, exc)
            return True
        if r.status in (PutStatus.SERVICE_NOT_AVAILABLE, PutStatus.DISK_FULL, PutStatus.NOT_MASTER):
            return False
        if r.status is not PutStatus.PUT_OK:
            log.warning(
                "delayed message %s for %s dropped: store answered %s",
                msg.msg_id,
                topic,
                r.status.value,
            )
            return True
        if hop is not None:
            self.stored(hop[4], hop[3])
        else:
            self.ctx.arrivals.notify(topic, queue_id)
        return True

    # -- persistence ----------------------------------------------------------------------

    def offsets(self) -> dict[int, int]:
        return dict(self._offsets)

    def reload(self) -> None:
        """Read the levels' offsets from the file again (a slave about to become the
        master: its file holds what the old master had delivered)."""
        self._offsets = load_json(self.path, DelayOffsetsFile).offsets
        self.timer.reload()

    def _snapshot(self, force: bool) -> DelayOffsetsFile | None:
        if not (self._dirty or force):
            return None
        self._dirty = False
        return DelayOffsetsFile(dict(self._offsets))

    def persist(self, force: bool = False) -> None:
        """Save the levels' offsets and the timer checkpoint now (the broker calls it at
        shutdown)."""
        self.timer.persist(force)
        super().persist(force)
