"""How busy a broker is: messages stored by sends and handed out by pulls, in total and
per second over the last minute (``txmq admin cluster``'s produce and consume rates), and,
when metrics are on, by topic and group (:class:`Tally`, read by broker/metrics.py)."""

from __future__ import annotations

import struct
import time
from bisect import bisect_left
from collections import deque

from txmq.observability.dist import Dist

__all__ = ["Tally", "Throughput"]


class Throughput:
    """Counters the request services bump, and rates from samples taken as they are read
    (and by :meth:`sample`, which the broker calls every few seconds)."""

    def __init__(self, window: float = 60.0, *, tally: Tally | None = None) -> None:
        self.window = window
        self.put = 0
        self.got = 0
        #: per topic and group, for the metrics endpoint (None: metrics are off)
        self.tally = tally
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
_STORE_TS_AT = 48  # a record's store timestamp (txmq.protocol.codec.HEADER's tenth field)


class Tally:
    """What happened, by topic and group, for the broker's metrics (broker/metrics.py reads
    it when scraped).  Only plain increments here: the services call these on their own
    event loop (the flush timing from the flush thread, into its own histogram); the
    broker sets ``Throughput.tally`` only when metrics are on.

    A stored message touches one dict entry, its (topic, type) size histogram: the
    messages-in and bytes-in counters are that histogram's count and sum, added up when
    scraped (:attr:`messages_in`, :attr:`bytes_in`)."""

    def __init__(self) -> None:
        #: (topic, message type) -> the sizes of the messages stored (count: messages in)
        self.sizes: dict[tuple[str, str], Dist] = {}
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

    @property
    def messages_in(self) -> dict[tuple[str, str], int]:
        """(topic, message type) -> messages stored (read when scraped)."""
        return {key: dist.count for key, dist in self.sizes.items()}

    @property
    def bytes_in(self) -> dict[str, int]:
        """topic -> body bytes stored (read when scraped)."""
        out: dict[str, int] = {}
        for (topic, _), dist in self.sizes.items():
            out[topic] = out.get(topic, 0) + int(dist.total)
        return out

    def stored(self, topic: str, kind: str, size: int) -> None:
        dist = self.sizes.get((topic, kind))
        if dist is None:
            dist = self.sizes[(topic, kind)] = Dist(SIZE_BUCKETS)
        dist.counts[bisect_left(SIZE_BUCKETS, size)] += 1  # Dist.observe, inlined
        dist.total += size

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
        now, bounds, counts = time.time() * 1000, dist.bounds, dist.counts
        total = 0.0
        for _, stored_at in messages:  # Dist.observe, inlined
            waited = now - stored_at
            if waited < 0:
                waited = 0
            counts[bisect_left(bounds, waited)] += 1
            total += waited
        dist.total += total

    def answered(self, code: int, response: str, started: float) -> None:
        self.rpc_dist(code, response).observe((time.perf_counter() - started) * 1000)

    def rpc_dist(self, code: int, response: str) -> Dist:
        """The latency histogram of (request code, response), made on first use (the
        request timer keeps the successes' at hand: broker/metrics.py timed_handler)."""
        key = (code, response)
        dist = self.rpc.get(key)
        if dist is None:
            dist = self.rpc[key] = Dist(RPC_BUCKETS_MS)
        return dist

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
