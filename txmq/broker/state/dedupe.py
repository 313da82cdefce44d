"""No duplicates from send retries: the window of recently stored message ids.

A send whose acknowledgement was lost (the broker was killed after storing, the connection
dropped, the answer came too late) is sent again by the producer with the same message id
(UNIQ_KEY).  The broker remembers the ids of the messages clients stored in the last
``dedupe_window_s`` seconds and answers a send whose id it stored then with the original's
result — same queue, queue offset, offset message id, store time (and, for a half message,
transaction offset) — storing nothing.  Like Kafka's idempotent producer, which drops a
retried batch by its producer id and sequence number, and NATS JetStream's ``Nats-Msg-Id``
duplicate window (2 minutes by default), whose model this is: any client that keeps a
message's id over its retries gets one copy per broker set, with no producer state on the
broker.

What counts.  Only what clients send (SEND_MESSAGE, SEND_BATCH_MESSAGE and the gRPC
endpoint's SendMessage, all through :class:`txmq.broker.sending.SendService`) is looked up
and remembered: a message, a delayed message's first stop in the schedule topic, a half
message.  The broker's own copies of a message — a delayed one delivered, a committed half,
a consumer retry, a dead letter, a parked half, a re-checked half's copy — keep the id on
purpose and never go through the window.  A send counts as a retry only if the stored
record has the same id, the same (real) topic and the same kind (half or not): an id
reused for another topic is another message.

How.  The key index already holds, for every record, the 32-bit hash of its UNIQ_KEY and
where the record is.  The window keeps only those hashes in memory, for the ids stored
recently: a send whose id's hash is not there (nearly every send: one CRC-32 and two set
lookups, then the hash is added) is new; one whose hash is there is looked up in the key
index, and only a record stored in the window that has its id, topic and kind makes it a
retry (anything else is a new message: a hash alike, an id stored before the window, a
send whose store was refused).  The hashes live in two generations; the older one is
dropped when the newer one holds half of ``dedupe_max_entries``: memory stays under the
cap (about 75 bytes an id) and the newest half of the cap is always known, so an id is
recognized for ``dedupe_window_s`` unless more than half the cap of newer ids came since.

Restarts and failovers.  Nothing is persisted but the store: on start the master, and a
slave when it is promoted (its key index is built from its copy of the log), load the
hashes of the key-index entries of the last ``dedupe_window_s`` (KEYS hashes come along: a
few more index lookups) — milliseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from zlib import crc32 as _crc32

from txmq.broker.store import MessageStore
from txmq.broker.store.index import UNIQ_SEED as _SEED
from txmq.protocol.codec import HEADER, record_topic_and_props
from txmq.protocol.message import (
    HALF_TOPIC,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    Prop,
    SysFlag,
    is_system_topic,
)
from txmq.protocol.wire import Sent

__all__ = ["DedupeWindow", "Original", "client_topic"]

_UNIQ = Prop.UNIQ_KEY
_REAL_TOPIC = Prop.REAL_TOPIC
#: where a client's delayed message waits first: a delay level's queue, or the timer
_WAITING = frozenset({SCHEDULE_TOPIC, TIMER_TOPIC})
_PREPARED = SysFlag.TRANSACTION_PREPARED_TYPE
_COMMIT = SysFlag.TRANSACTION_COMMIT_TYPE
_MASK = SysFlag.TRANSACTION_MASK


def client_topic(topic: str, sys_flag: int, props: dict[str, str]) -> str | None:
    """The topic a client sent a record to, if a client's send stored it (a message, a
    delayed message's first stop in the schedule or timer topic, a half message); None for what the
    broker stores itself (committed halves, retries, dead letters, op records, ...)."""
    if topic == HALF_TOPIC:
        if sys_flag & _MASK != _PREPARED or Prop.RECHECK_OF in props:
            return None
        return props.get(_REAL_TOPIC)
    if topic in _WAITING:
        real = props.get(_REAL_TOPIC)
        return None if not real or is_system_topic(real) else real
    if is_system_topic(topic) or sys_flag & _MASK == _COMMIT:
        return None
    return topic


@dataclass(frozen=True, slots=True)
class Original:
    """The stored record of a message id: what its send was answered."""

    topic: str
    half: bool
    queue_id: int
    queue_offset: int
    commit_log_offset: int
    end_offset: int
    store_timestamp: int

    def sent(self, msg_id: str) -> Sent:
        return Sent(
            msg_id=msg_id,
            offset_msg_id=f"{self.commit_log_offset:016X}",
            queue_id=self.queue_id,
            queue_offset=self.queue_offset,
            store_timestamp=self.store_timestamp,
            transaction_offset=self.commit_log_offset if self.half else -1,
        )


def _original(rec: bytes, msg_id: str) -> Original | None:
    """The record ``rec`` (of ``msg_id``) as a client's send stored it, or None if the
    broker stored it itself."""
    f = HEADER.unpack_from(rec)
    phy = f[6]
    topic, props = record_topic_and_props(rec)
    if props.get(_UNIQ) != msg_id:
        return None
    real = client_topic(topic, f[7], props)
    if real is None:
        return None
    queue_id = f[3]
    if topic == HALF_TOPIC or topic in _WAITING:
        try:
            queue_id = int(props.get(Prop.REAL_QID, ""))
        except ValueError:
            return None
    return Original(real, topic == HALF_TOPIC, queue_id, f[5], phy, phy + f[0], f[9])


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class DedupeWindow:
    """The hashes of the ids of the messages clients stored recently, and the key index
    behind them (see the module documentation)."""

    __slots__ = ("_cur", "_half", "_prev", "duplicates", "max_entries", "window_ms")

    def __init__(self, window_s: float, max_entries: int) -> None:
        self.window_ms = round(window_s * 1000)
        self.max_entries = max_entries
        self._half = max(max_entries // 2, 1)
        #: the generations of hashes: the newer one and the older one
        self._cur: set[int] = set()
        self._prev: set[int] = set()
        #: retried copies answered (not stored) since the broker started
        self.duplicates = 0

    def __len__(self) -> int:
        return len(self._cur) + len(self._prev)

    def __contains__(self, msg_id: str) -> bool:
        h = _crc32(msg_id.encode(), _SEED)
        return h in self._cur or h in self._prev

    def admit(
        self, store: MessageStore, msg_id: str, topic: str, half: bool, now_ms: int | None = None
    ) -> Original | None:
        """None if the send of ``msg_id`` to ``topic`` (a half message or not) is a new
        message — its id is remembered from now on: store it — else the stored original
        it is a retry of (the same id, topic and kind, stored in the window)."""
        h = _crc32(msg_id.encode(), _SEED)
        if h in self._cur or h in self._prev:
            now = _now_ms() if now_ms is None else now_ms
            for rec in reversed(store.query_uniq_key_since(msg_id, now - self.window_ms)):
                found = _original(rec, msg_id)  # the oldest first: the client's
                if found is not None and found.topic == topic and found.half == half:
                    self.duplicates += 1
                    return found
            return None  # a hash alike, or stored before the window: a new message
        cur = self._cur
        cur.add(h)  # (if the store refuses it, a retry only costs an index lookup)
        if len(cur) >= self._half:  # the older generation goes: half the cap came since
            self._prev = cur
            self._cur = set()
        return None

    # -- start and promotion ---------------------------------------------------------------

    def load(self, store: MessageStore, now_ms: int | None = None) -> int:
        """Forget everything, then remember the ids stored in the window before ``now_ms``
        (their hashes, from the key index; at most the cap, the newest); how many."""
        now = _now_ms() if now_ms is None else now_ms
        hashes = store.key_hashes_since(now - self.window_ms)
        keep = hashes[len(hashes) - min(len(hashes), 2 * self._half - 1) :]
        split = len(keep) - min(len(keep), self._half - 1)  # the newer generation not full
        self._prev = set(keep[:split])
        self._cur = set(keep[split:])
        return len(keep)
