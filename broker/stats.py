"""How busy a broker is: messages stored by sends and handed out by pulls, in total and
per second over the last minute (``txmq admin cluster``'s produce and consume rates), and,
when metrics are on, by topic and group (:class:`Tally`, read by broker/metrics.py)."""

from __future__ import annotations

import struct
import time
from bisect import bisect_left
from collections import deque

__all__ = ["Dist", "Tally", "Throughput"]


class Throughput:
    """Counters the request services bump, and rates from samples taken as they are read
    (and by :meth:`sample`, which the broker calls every few seconds)."""

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self.put = 0
        self.got = 0
        #: per topic and group, for the metrics endpoint (None: metrics are off)
        self.tally: Tally | None = None
        self._samples: deque[tuple[float, int, int]] = deque()

    def sample(self) -> None:
        now = time.monotonic()
        self._samples.append((now, self.put, self.got))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()

    def rates(self) -> tuple[float, float]:
        """(messages stored per second, messages pulled per second) since the oldest
        sample within the window."""
        self.sample()
        t0, put0, got0 = self._samples[0]
        elapsed = time.monotonic() - t0
        if elapsed <= 0:
            return 0.0, 0.0
        return (self.put - put0) / elapsed, (self.got - got0) / elapsed


#: RocketMQ 5's buckets: message sizes in bytes, RPC latency in ms
SIZE_BUCKETS = (1024, 4096, 512 * 1024, 1024 * 1024, 2 * 1024 * 1024, 4 * 1024 * 1024)
RPC_BUCKETS_MS = (1, 3, 5, 10, 100, 1000, 3000)
#: store -> handed to a consumer, in ms
DELIVERY_BUCKETS_MS = (1, 5, 10, 100, 1000, 3000, 10_000, 60_000, 600_000)
#: one commit-log fsync, in seconds
FLUSH_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_STORE_TS = struct.Struct("<Q")
_STORE_TS_AT = 48  # a record's store timestamp (txmq.codec.HEADER's tenth field)


class Dist:
    """A histogram of plain numbers: how many observations fell at or under each bound
    (the last count: above them all) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class Tally:
    """What happened, by topic and group, for the broker's metrics (broker/metrics.py reads
    it when scraped).  Only plain increments here: the services call these on their own
    event loop (the flush timing from the flush thread, into its own histogram); the
    broker sets ``Throughput.tally`` only when metrics are on."""

    def __init__(self) -> None:
        #: (topic, message type) -> messages stored / their sizes; topic -> bytes
        self.messages_in: dict[tuple[str, str], int] = {}
        self.sizes: dict[tuple[str, str], Dist] = {}
        self.bytes_in: dict[str, int] = {}
        #: (topic, consumer group) -> messages / bytes pulled, store-to-pull latency
        self.messages_out: dict[tuple[str, str], int] = {}
        self.bytes_out: dict[tuple[str, str], int] = {}
        self.delivery: dict[tuple[str, str], Dist] = {}
        #: (group, topic, queue id) -> the next offset handed out by a pull
        self.pulled: dict[tuple[str, str, int], int] = {}
        #: (request code, response) -> latency (answered requests; long polls not)
        self.rpc: dict[tuple[int, str], Dist] = {}
        #: (producer group, what: prepared / committed / rolled_back / parked) -> halves
        self.halves: dict[tuple[str, str], int] = {}
        #: producer group -> check-backs sent; (group, state) -> their answers
        self.checks: dict[str, int] = {}
        self.check_answers: dict[tuple[str, str], int] = {}
        #: consumer group -> messages sent back for a retry / moved to its DLQ
        self.retries: dict[str, int] = {}
        self.dead: dict[str, int] = {}
        self.flush = Dist(FLUSH_BUCKETS_S)

    def stored(self, topic: str, kind: str, size: int) -> None:
        key = (topic, kind)
        self.messages_in[key] = self.messages_in.get(key, 0) + 1
        self.bytes_in[topic] = self.bytes_in.get(topic, 0) + size
        dist = self.sizes.get(key)
        if dist is None:
            dist = self.sizes[key] = Dist(SIZE_BUCKETS)
        dist.observe(size)

    def handed_out(
        self, group: str, topic: str, queue_id: int, records: list[bytes], next_offset: int
    ) -> None:
        self.pulled[(group, topic, queue_id)] = next_offset
        if not records:
            return
        key = (topic, group)
        self.messages_out[key] = self.messages_out.get(key, 0) + len(records)
        self.bytes_out[key] = self.bytes_out.get(key, 0) + sum(map(len, records))
        dist = self.delivery.get(key)
        if dist is None:
            dist = self.delivery[key] = Dist(DELIVERY_BUCKETS_MS)
        now, bounds, counts, unpack = (
            time.time() * 1000,
            dist.bounds,
            dist.counts,
            _STORE_TS.unpack_from,
        )
        total = 0.0
        for record in records:  # Dist.observe, inlined: this runs for every message pulled
            waited = now - unpack(record, _STORE_TS_AT)[0]
            if waited < 0:
                waited = 0
            counts[bisect_left(bounds, waited)] += 1
            total += waited
        dist.total += total

    def popped(self, group: str, topic: str, messages: list[tuple[int, int]]) -> None:
        """Messages handed out by a pop: (body size, store timestamp) each."""
        key = (topic, group)
        self.messages_out[key] = self.messages_out.get(key, 0) + len(messages)
        self.bytes_out[key] = self.bytes_out.get(key, 0) + sum(size for size, _ in messages)
        dist = self.delivery.get(key)
        if dist is None:
            dist = self.delivery[key] = Dist(DELIVERY_BUCKETS_MS)
        now = time.time() * 1000
        for _, stored_at in messages:
            dist.observe(max(now - stored_at, 0))

    def answered(self, code: int, response: str, started: float) -> None:
        key = (code, response)
        dist = self.rpc.get(key)
        if dist is None:
            dist = self.rpc[key] = Dist(RPC_BUCKETS_MS)
        dist.observe((time.perf_counter() - started) * 1000)

    def half(self, group: str, what: str) -> None:
        key = (group, what)
        self.halves[key] = self.halves.get(key, 0) + 1

    def checked(self, group: str) -> None:
        self.checks[group] = self.checks.get(group, 0) + 1

    def check_answer(self, group: str, state: str) -> None:
        key = (group, state)
        self.check_answers[key] = self.check_answers.get(key, 0) + 1

    def retried(self, group: str, dead: bool) -> None:
        counts = self.dead if dead else self.retries
        counts[group] = counts.get(group, 0) + 1
