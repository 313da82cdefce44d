"""Timer messages: delivery at an exact time (RocketMQ 5's ``TimerMessageStore``).

A message sent with DELIVER_AT (``TIMER_DELIVER_MS``, ms since the epoch; what a client's
``deliver_at`` / ``delay`` and a gRPC delivery timestamp become) at most
``timer_max_delay_s`` ahead is stored once, in ``RMQ_SYS_WHEEL_TIMER`` queue 0, with its
real topic and queue in REAL_TOPIC / REAL_QID.  The message stays in the commit log; the
timer log is that queue's consume queue: one 20-byte entry per timer, (commit-log offset,
size, delivery time), appended by the store's dispatcher as the message is stored, in its
own files under ``<store>/consumequeue/RMQ_SYS_WHEEL_TIMER/0/``, flushed, checkpointed and
rebuilt after a crash like every consume queue.

In memory, a timing wheel: a slot per second holding its timers' (delivery time, offset,
size, log position), and a heap of the seconds that have a slot.  One task reads new
entries of the timer log into the wheel, and delivers what is due in (delivery time,
commit-log offset) order: each due message is read from the commit log and stored in its
real topic and queue (a batch at a time), keeping its UNIQ_KEY and DELIVER_AT, with
TXMQ_TIMER_OF naming the timer's commit-log offset; it sleeps until the next delivery time
or until a sooner timer is stored.

Exactly once across restarts: deliveries happen in key order, so what was delivered is a
prefix of that order.  ``<store>/config/timer_checkpoint.json`` keeps the last delivered
key, the commit-log end when it was written and the timer-log position below which every
timer is delivered (every few seconds and at shutdown).  On start the wheel is rebuilt from
the timer log past that position, leaving out keys up to the checkpoint's and timers whose
delivered copy (TXMQ_TIMER_OF) is in the commit log past the checkpoint's end — the copies
made after the last checkpoint, found by a scan of those few seconds of log.  What the
store lost in a crash (async flush) is lost with its copy and delivered again.

Recall (RocketMQ 5's): a timer message not yet delivered can be recalled by its id.  The
recall is a record in ``RMQ_SYS_TIMER_RECALL`` (the recalled id and its delivery time), in
the commit log like everything else — flushed before it is answered, copied to the slaves,
read again at start — and the delivery skips a recalled timer.
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec

from txmq.broker.state.context import BrokerContext
from txmq.broker.state.persisting import SavedState
from txmq.broker.state.putting import WAITING_PROPS, put_or_raise, real_destination
from txmq.broker.store import PutResult, PutStatus
from txmq.broker.store.consumequeue import CQ_ENTRY
from txmq.broker.store.scanner import Scanner
from txmq.protocol.codec import decode_record
from txmq.protocol.message import RECALL_TOPIC, TIMER_TOPIC, Prop
from txmq.protocol.wire.errors import MessageNotFound, MessageTooLarge
from txmq.server.jsonfile import load_json

__all__ = ["TimerCheckpoint", "TimerService", "TimerWheel"]

log = logging.getLogger("txmq.broker.timer")

_BATCH = 256
_READ = 4096  # timer-log entries read at a time
_MARK = Prop.TIMER_OF.encode()
#: a recall record's property: the recalled timer's delivery time
_RECALL_DUE = "TXMQ_RECALL_DUE"

#: a timer in the wheel: (delivery ms, commit-log offset, size, timer-log position)
Entry = tuple[int, int, int, int]


class TimerCheckpoint(msgspec.Struct):
    """``timer_checkpoint.json``: what the timer service has delivered."""

    #: the key (delivery ms, commit-log offset) of the last timer delivered
    delivered_ms: int = -1
    delivered_offset: int = -1
    #: the commit log's end when this was written: later copies are found by a scan
    commit_log: int = 0
    #: every timer below this position of the timer log is delivered
    low: int = 0


class TimerWheel:
    """Timers by second: a slot (list) per second, a heap of the seconds with a slot."""

    def __init__(self) -> None:
        self._slots: dict[int, list[Entry]] = {}
        self._sorted: set[int] = set()
        self._heads: list[int] = []
        self.count = 0

    def add(self, entry: Entry) -> None:
        second = entry[0] // 1000
        slot = self._slots.get(second)
        if slot is None:
            self._slots[second] = [entry]
            heapq.heappush(self._heads, second)
        else:
            slot.append(entry)
            self._sorted.discard(second)
        self.count += 1

    def _head(self) -> list[Entry] | None:
        if not self._heads:
            return None
        second = self._heads[0]
        slot = self._slots[second]
        if second not in self._sorted:
            slot.sort()
            self._sorted.add(second)
        return slot

    def next_due(self) -> int | None:
        slot = self._head()
        return slot[0][0] if slot else None

    def take(self, now_ms: int, limit: int) -> list[Entry]:
        """Up to ``limit`` timers due by ``now_ms``, in (delivery time, offset) order."""
        out: list[Entry] = []
        while len(out) < limit:
            slot = self._head()
            if slot is None or slot[0][0] > now_ms:
                break
            n = 0
            want = limit - len(out)
            while n < len(slot) and n < want and slot[n][0] <= now_ms:
                n += 1
            out.extend(slot[:n])
            del slot[:n]
            if not slot:
                second = heapq.heappop(self._heads)
                del self._slots[second]
                self._sorted.discard(second)
        self.count -= len(out)
        return out

    def put_back(self, entries: list[Entry]) -> None:
        for e in entries:
            self.add(e)


class TimerService(SavedState):
    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.max_delay_ms = ctx.config.timer_max_delay_s * 1000
        self.persist_interval_s = ctx.config.offset_persist_interval_s
        self.path = ctx.config.store / "config" / "timer_checkpoint.json"
        self.what = "the timer checkpoint"
        self.wheel = TimerWheel()
        self._wake = anyio.Event()
        self._next: int | None = None
        self._ready = False
        self._dirty = False
        self._load()
        ctx.clock.on_advance.append(lambda: self._wake.set())

    # -- the send side --------------------------------------------------------------------

    def prepare(
        self, topic: str, queue_id: int, props: dict[str, str], deliver_at_ms: int
    ) -> tuple[str, int, dict[str, str], int] | None:
        """Where to store a timer message (None: it is due: store it in its topic)."""
        if deliver_at_ms <= self.ctx.clock.now_ms():
            return None
        stored = {k: v for k, v in props.items() if k not in WAITING_PROPS}
        stored[Prop.DELIVER_AT] = str(deliver_at_ms)
        stored[Prop.REAL_TOPIC] = topic
        stored[Prop.REAL_QID] = str(queue_id)
        return TIMER_TOPIC, 0, stored, deliver_at_ms

    def recall(self, topic: str, msg_id: str) -> tuple[int, PutResult]:
        """Recall the timer message ``msg_id`` of ``topic``: its delivery time and the
        recall record's put (answer once it is flushed); MessageNotFound when no such timer
        waits here."""
        timer = None
        delivered = False
        for raw in self.store.query_all_by_uniq_key(msg_id):
            msg = decode_record(raw)
            props = msg.all_properties
            if msg.topic == TIMER_TOPIC and props.get(Prop.REAL_TOPIC) == topic:
                timer = msg
            elif props.get(Prop.TIMER_OF) is not None and msg.topic == topic:
                delivered = True
        if timer is None:
            raise MessageNotFound(f"no timer message {msg_id} of topic {topic} on this broker")
        due = int(timer.all_properties.get(Prop.DELIVER_AT, "0"))
        if delivered or (due, timer.commit_log_offset) <= self._key:
            raise MessageNotFound(f"timer message {msg_id} was delivered already: too late")
        if msg_id in self._recalled:
            raise MessageNotFound(f"timer message {msg_id} was recalled already")
        if self.ctx.topics.get(RECALL_TOPIC) is None:
            self.ctx.topics.create_or_update(RECALL_TOPIC, 1, system=True)
        r = put_or_raise(
            self.store,
            topic=RECALL_TOPIC,
            queue_id=0,
            body=msg_id.encode(),
            properties={_RECALL_DUE: str(due), Prop.REAL_TOPIC: topic},
            born_timestamp=self.ctx.clock.now_ms(),
        )
        self._recalled[msg_id] = due
        log.info("timer message %s of %s (due %d) recalled", msg_id, topic, due)
        return due, r

    def _load_recalls(self) -> None:
        """The recalls of timers not delivered yet, from their records."""
        self._recalled.clear()
        cq = self.store.consume_queue(RECALL_TOPIC, 0)
        if cq is None:
            return
        pos = cq.min_offset
        while pos < cq.max_offset:
            raw = cq.read(pos, _READ)
            if not raw:
                pos = (pos // cq.per_file + 1) * cq.per_file
                continue
            for phy, _size, _code in CQ_ENTRY.iter_unpack(raw):
                record = self.store.look_message_by_offset(phy)
                if record is None:
                    continue
                msg = decode_record(record)
                due = int(msg.all_properties.get(_RECALL_DUE, "0"))
                if due >= self._key[0]:
                    self._recalled[msg.body.decode()] = due
            pos += len(raw) // CQ_ENTRY.size

    def stored(self, due_ms: int) -> None:
        """A timer message was stored: wake the task if it is due sooner than it waits."""
        if self._next is None or due_ms < self._next:
            self._wake.set()

    @property
    def pending(self) -> int:
        return self.wheel.count

    # -- recovery -------------------------------------------------------------------------

    def _load(self) -> None:
        ck = load_json(self.path, TimerCheckpoint)
        self._key = (ck.delivered_ms, ck.delivered_offset)
        self._low = ck.low
        self._scan_from = ck.commit_log
        self._done: set[int] = set()
        self._enqueued = ck.low
        #: recalled timers not delivered yet: message id -> delivery time
        self._recalled: dict[str, int] = {}
        self.wheel = TimerWheel()
        self._ready = False

    def reload(self) -> None:
        """Read the checkpoint again and rebuild (a slave about to become the master)."""
        self._load()

    def _timer_log(self) -> Any:
        return self.store.consume_queue(TIMER_TOPIC, 0)

    def _recover(self) -> None:
        """Rebuild the wheel: the timer log past the checkpoint, minus what was delivered."""
        cq = self._timer_log()
        low = max(self._low, cq.min_offset) if cq is not None else self._low
        self._low = self._enqueued = low
        copies: set[int] = set()
        if cq is not None and low < cq.max_offset:
            first = cq.entry(low)
            start = max(self._scan_from, first[0] if first else 0, self.store.commit_log_min_offset)
            scanner = Scanner(self.store.commit_log, start)
            for _off, buf, pos, size in scanner:
                if buf.find(_MARK, pos, pos + size) < 0:
                    continue
                raw = decode_record(bytes(buf[pos : pos + size])).all_properties.get(Prop.TIMER_OF)
                if raw is not None and raw.isdigit():
                    copies.add(int(raw))
        self._copies = copies
        self._load_recalls()
        self._enqueue(recovering=True)
        self._copies = set()
        self._ready = True
        log.info(
            "timers: %d pending (timer log from %d; %d delivered after the checkpoint)",
            self.wheel.count,
            low,
            len(copies),
        )

    def _enqueue(self, recovering: bool = False) -> None:
        """Read the timer log's new entries into the wheel."""
        cq = self._timer_log()
        if cq is None:
            return
        hi = cq.max_offset
        key = self._key
        while self._enqueued < hi:
            pos = self._enqueued
            raw = cq.read(pos, _READ)
            if not raw:  # a gap between files: go on at the next one
                self._enqueued = min(hi, (pos // cq.per_file + 1) * cq.per_file)
                continue
            for i, (phy, size, due) in enumerate(CQ_ENTRY.iter_unpack(raw)):
                if recovering and ((due, phy) <= key or phy in self._copies):
                    self._delivered(pos + i)
                else:
                    self.wheel.add((due, phy, size, pos + i))
            self._enqueued = pos + len(raw) // CQ_ENTRY.size

    def _delivered(self, position: int) -> None:
        if position == self._low:
            self._low += 1
            done = self._done
            while self._low in done:
                done.remove(self._low)
                self._low += 1
        else:
            self._done.add(position)
        self._dirty = True

    # -- delivery -------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Deliver timers until cancelled."""
        cfg = self.ctx.topics.get(TIMER_TOPIC)
        if cfg is None:
            self.ctx.topics.create_or_update(TIMER_TOPIC, 1, system=True)
        if not self._ready:
            self._recover()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._persist_loop)
            task_status.started()
            await self._loop()

    async def _loop(self) -> None:
        while True:
            self._wake = event = anyio.Event()
            self._next = None  # whatever is stored meanwhile wakes the loop
            # before reading the log: a timer read later is due after now
            now = self.ctx.clock.now_ms()
            self._enqueue()
            due = self.wheel.take(now, _BATCH)
            if due:
                if not self._deliver(due):
                    self.wheel.put_back(due)
                    await anyio.sleep(1)  # the store refused (shutting down, disk full)
                else:
                    await anyio.lowlevel.checkpoint()
                continue
            self._next = nxt = self.wheel.next_due()
            if nxt is None:
                await event.wait()
            else:
                with anyio.move_on_after(max(nxt - self.ctx.clock.now_ms(), 0) / 1000):
                    await event.wait()

    def _deliver(self, entries: list[Entry]) -> bool:
        """Store the due messages in their topics; False if the store refused them all."""
        items: list[dict[str, Any]] = []
        kept: list[Entry] = []
        for entry in entries:
            item = self._item(entry)
            if item is None:  # nothing to deliver: done with it
                self._mark(entry)
            else:
                items.append(item)
                kept.append(entry)
        if not items:
            return True
        results: list[PutResult | None]
        try:
            results = list(self.store.put_batch(items))
        except MessageTooLarge:  # one at a time, to drop only the one too large
            results = []
            for item in items:
                try:
                    results.extend(self.store.put_batch([item]))
                except MessageTooLarge as exc:
                    log.warning("timer message for %s dropped: %s", item["topic"], exc)
                    results.append(None)
        refused = (PutStatus.SERVICE_NOT_AVAILABLE, PutStatus.DISK_FULL, PutStatus.NOT_MASTER)
        again: list[Entry] = []
        for entry, item, r in zip(kept, items, results, strict=True):
            if r is not None and r.status in refused:
                again.append(entry)
                continue
            if r is not None and r.status is PutStatus.PUT_OK:
                self.ctx.arrivals.notify(item["topic"], item["queue_id"])
            elif r is not None:
                log.warning(
                    "timer message for %s dropped: store answered %s", item["topic"], r.status.value
                )
            self._mark(entry)
        if again:
            if len(again) == len(kept):
                return False
            self.wheel.put_back(again)
        return True

    def _mark(self, entry: Entry) -> None:
        self._key = max(self._key, (entry[0], entry[1]))
        self._delivered(entry[3])

    def _item(self, entry: Entry) -> dict[str, Any] | None:
        _due, phy, _size, _pos = entry
        record = self.store.look_message_by_offset(phy)
        if record is None:
            log.warning("timer message at %d is gone from the commit log; skipped", phy)
            return None
        msg = decode_record(record)
        if self._recalled.pop(msg.msg_id, None) is not None:
            log.info("timer message %s of %s not delivered: it was recalled", msg.msg_id, msg.topic)
            return None
        where = real_destination(self.ctx.topics, msg, "timer")
        if where is None:
            return None
        topic, queue_id = where
        out = {k: v for k, v in msg.all_properties.items() if k not in WAITING_PROPS}
        out[Prop.TIMER_OF] = str(phy)
        return {
            "topic": topic,
            "queue_id": queue_id,
            "body": msg.body,
            "properties": out,
            "born_timestamp": msg.born_timestamp,
            "sys_flag": msg.sys_flag,
            "flag": msg.flag,
            "reconsume_times": msg.reconsume_times,
        }

    # -- persistence ----------------------------------------------------------------------

    def _snapshot(self, force: bool) -> TimerCheckpoint | None:
        if not (self._dirty or force) or not self._ready:
            return None
        self._dirty = False
        return TimerCheckpoint(
            delivered_ms=self._key[0],
            delivered_offset=self._key[1],
            commit_log=self.store.commit_log_max_offset,
            low=self._low,
        )

    def _flushed_to(self, data: TimerCheckpoint) -> int:
        # the copies of what it counts as delivered are on disk before it is
        return data.commit_log
