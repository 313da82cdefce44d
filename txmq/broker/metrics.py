"""The broker's metrics for Prometheus: ``GET /metrics`` on ``metrics_port``.

Names and labels are RocketMQ 5's where it has them (``rocketmq_messages_in_total``,
``rocketmq_consumer_lag_messages``, ...) and txmq's for the rest (half messages, check-backs,
retries and dead letters, the commit log, replication).  Nothing here runs per message: the
services bump plain counters in a :class:`~txmq.broker.state.stats.Tally` (only while metrics are
on), and :class:`BrokerCollector` turns them, and the broker's own state (store offsets,
committed offsets, pending halves, pop in-flight entries, replication lag), into metric
families when scraped.  The endpoint is an HTTP handler on the broker's own event loop, so
a scrape reads the state between two requests, never in the middle of one.

The server (broker/server.py) fills a :class:`MetricsSources` and serves
:func:`registry_for`'s registry with :func:`txmq.broker.metrics_endpoint.start_metrics`;
this module imports nothing of the server.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from txmq.broker.state.context import BrokerContext
from txmq.broker.state.stats import RPC_BUCKETS_MS, Tally
from txmq.broker.store import MessageStore
from txmq.observability.dist import Dist, histogram_family
from txmq.protocol.connection import Connection, Handler, HandlerResult
from txmq.protocol.message import PARKED_TOPIC
from txmq.protocol.wire.base import Response, WithBody, requests
from txmq.protocol.wire.frame import Frame

__all__ = [
    "BrokerCollector",
    "MetricsSources",
    "registry_for",
    "time_flushes",
    "timed_handler",
]

_DLQ_PREFIX = "%DLQ%"
#: an answer at once (anything else: a future, timed when it settles, or a coroutine)
_REPLIES = (Response, WithBody)


class Half(Protocol):
    """A pending half message as the metrics read it
    (txmq.broker.transactions.service.PendingHalf)."""

    @property
    def group(self) -> str: ...
    @property
    def store_timestamp(self) -> int: ...
    @property
    def check_times(self) -> int: ...


@dataclass(frozen=True, slots=True)
class MetricsSources:
    """What the collector reads, filled by the server."""

    ctx: BrokerContext
    tally: Tally
    version: str
    #: the pending half messages
    pending: Callable[[], Iterable[Half]]
    #: (group, topic) -> messages popped and not acked yet (RocketMQ 5's pop consumption)
    pop_inflight: Callable[[], dict[tuple[str, str], int]]
    #: Replication.describe(): role, and the slaves' lag (a master) or its own (a slave)
    replication: Callable[[], dict[str, object]]
    #: this replica's id in its broker set
    broker_id: Callable[[], int]
    #: open client connections
    connections: Callable[[], int]


# -- the collector ------------------------------------------------------------------------


def _counter(name: str, doc: str, labels: list[str], values: dict[Any, int]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in values.items():
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family


_request_names: dict[int, str] = {}


def _request_name(code: int) -> str:
    """``SendMessage`` -> ``send_message`` (RocketMQ's request_code label)."""
    name = _request_names.get(code)
    if name is None:
        kinds = [cls for (c, _), cls in sorted(requests().items()) if c == code]
        name = _request_names[code] = _snake(kinds[-1].__name__) if kinds else str(code)
    return name


class BrokerCollector:
    """Metric families from a broker's tally and state, made when scraped."""

    def __init__(self, sources: MetricsSources) -> None:
        self.src = sources

    def collect(self) -> Iterator[Metric]:
        yield from self._broker()
        yield from self._messages()
        yield from self._consumers()
        yield from self._transactions()
        yield from self._retries()
        yield from self._store()
        yield from self._replication()

    def _broker(self) -> Iterator[Metric]:
        src, cfg = self.src, self.src.ctx.config
        role = str(src.replication().get("role", ""))
        info = GaugeMetricFamily(
            "txmq_broker_info",
            "This broker: its cluster, broker set, id in the set, role and version (value 1)",
            labels=["cluster", "broker_name", "broker_id", "role", "version"],
        )
        info.add_metric([cfg.cluster, cfg.broker_name, str(src.broker_id()), role, src.version], 1)
        yield info
        yield GaugeMetricFamily(
            "txmq_broker_connections", "Open client connections", value=src.connections()
        )
        yield GaugeMetricFamily(
            "rocketmq_topic_number", "Topics on this broker", value=len(src.ctx.topics.all())
        )

    def _messages(self) -> Iterator[Metric]:
        t = self.src.tally
        yield _counter(
            "rocketmq_messages_in",
            "Messages stored in a topic (committed transactional messages when committed)",
            ["topic", "message_type"],
            t.messages_in,
        )
        yield _counter(
            "rocketmq_throughput_in", "Body bytes stored in a topic", ["topic"], t.bytes_in
        )
        yield histogram_family(
            "rocketmq_message_size",
            "Body sizes of the messages stored, in bytes",
            ["topic", "message_type"],
            ((list(k), d) for k, d in t.sizes.items()),
        )
        yield _counter(
            "rocketmq_messages_out",
            "Messages handed to a consumer group (pulls and pops)",
            ["topic", "consumer_group"],
            t.messages_out,
        )
        yield _counter(
            "rocketmq_throughput_out",
            "Bytes handed to a consumer group (pulled records, popped bodies)",
            ["topic", "consumer_group"],
            t.bytes_out,
        )
        yield histogram_family(
            "rocketmq_send_to_consumer_latency",
            "From a message's store time to handing it to a consumer, in milliseconds",
            ["topic", "consumer_group"],
            ((list(k), d) for k, d in t.delivery.items()),
        )
        yield histogram_family(
            "rocketmq_rpc_latency",
            "Time to answer a request, in milliseconds (long polls that waited not counted)",
            ["protocol_type", "request_code", "response_code"],
            (
                (["remoting", _request_name(code), response], d)
                for (code, response), d in t.rpc.items()
            ),
        )

    def _consumers(self) -> Iterator[Metric]:
        src, store = self.src, self.src.ctx.store
        lag: dict[tuple[str, str], int] = {}
        inflight: dict[tuple[str, str], int] = {}
        ready: dict[tuple[str, str], int] = {}
        pulled = src.tally.pulled
        for group, topics in src.ctx.offsets.snapshot().items():
            for topic, queues in topics.items():
                key = (topic, group)
                behind = flying = waiting = 0
                for queue_id, committed in queues.items():
                    end = store.max_offset(topic, queue_id)
                    behind += max(end - committed, 0)
                    handed = max(pulled.get((group, topic, queue_id), committed), committed)
                    flying += max(min(handed, end) - committed, 0)
                    waiting += max(end - handed, 0)
                lag[key], inflight[key], ready[key] = behind, flying, waiting
        for (group, topic), n in src.pop_inflight().items():
            inflight[(topic, group)] = inflight.get((topic, group), 0) + n
        for name, doc, values in (
            (
                "rocketmq_consumer_lag_messages",
                "Messages a consumer group has not committed yet (max offset - committed)",
                lag,
            ),
            (
                "rocketmq_consumer_inflight_messages",
                "Messages handed to a consumer group and not committed (or popped, not acked)",
                inflight,
            ),
            (
                "rocketmq_consumer_ready_messages",
                "Messages not handed to the consumer group yet",
                ready,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["topic", "consumer_group"])
            for (topic, group), value in values.items():
                family.add_metric([topic, group], value)
            yield family
        consumers = src.ctx.consumers
        conns = GaugeMetricFamily(
            "rocketmq_consumer_connections",
            "Consumers of a group connected to this broker",
            labels=["consumer_group"],
        )
        groups = consumers.groups()
        for group in groups:
            conns.add_metric([group], len(consumers.client_ids(group)))
        yield conns
        yield GaugeMetricFamily(
            "rocketmq_consumer_group_number",
            "Consumer groups with a consumer connected",
            value=len(groups),
        )

    def _transactions(self) -> Iterator[Metric]:
        src, t = self.src, self.src.tally
        now = time.time() * 1000
        count: dict[str, int] = {}
        oldest: dict[str, float] = {}
        checks: dict[str, int] = {}
        for half in src.pending():
            g = half.group
            count[g] = count.get(g, 0) + 1
            age = max(now - half.store_timestamp, 0) / 1000
            if age > oldest.get(g, -1.0):
                oldest[g] = age
            if half.check_times > checks.get(g, -1):
                checks[g] = half.check_times
        for name, doc, values in (
            ("txmq_half_messages_pending", "Half messages not committed or rolled back", count),
            (
                "txmq_half_messages_oldest_age_seconds",
                "Age of the oldest pending half message (since stored)",
                oldest,
            ),
            (
                "txmq_half_messages_max_check_times",
                "The most check-backs any pending half message has had",
                checks,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["producer_group"])
            for group, value in values.items():
                family.add_metric([group], value)
            yield family
        for what, doc in (
            ("prepared", "Half messages stored"),
            ("committed", "Half messages committed (the real message stored)"),
            ("rolled_back", "Half messages rolled back"),
            ("parked", "Half messages parked after the last check-back, for an operator"),
        ):
            yield _counter(
                f"txmq_half_messages_{what}",
                doc,
                ["producer_group"],
                {g: n for (g, w), n in t.halves.items() if w == what},
            )
        yield _counter(
            "txmq_half_messages_checked",
            "Check-backs sent to a producer group",
            ["producer_group"],
            t.checks,
        )
        yield _counter(
            "txmq_transaction_check_answers",
            "Answers to check-backs, by state (COMMIT, ROLLBACK, UNKNOWN)",
            ["producer_group", "state"],
            t.check_answers,
        )
        store = src.ctx.store
        parked = store.max_offset(PARKED_TOPIC, 0) - store.min_offset(PARKED_TOPIC, 0)
        yield GaugeMetricFamily(
            "txmq_parked_transactions",
            f"Parked half messages held in {PARKED_TOPIC} (all time, until retention)",
            value=max(parked, 0),
        )

    def _retries(self) -> Iterator[Metric]:
        t, store = self.src.tally, self.src.ctx.store
        yield _counter(
            "txmq_retry_messages",
            "Messages a consumer group sent back for another attempt",
            ["consumer_group"],
            t.retries,
        )
        yield _counter(
            "txmq_dlq_messages",
            "Messages moved to a consumer group's dead-letter queue",
            ["consumer_group"],
            t.dead,
        )
        depth = GaugeMetricFamily(
            "txmq_dlq_depth_messages",
            "Messages held in a consumer group's dead-letter queue (%DLQ%<group>)",
            labels=["consumer_group"],
        )
        for cfg in self.src.ctx.topics.all():
            if cfg.name.startswith(_DLQ_PREFIX):
                held = sum(
                    store.max_offset(cfg.name, q) - store.min_offset(cfg.name, q)
                    for q in range(cfg.queue_nums)
                )
                depth.add_metric([cfg.name[len(_DLQ_PREFIX) :]], max(held, 0))
        yield depth

    def _store(self) -> Iterator[Metric]:
        store = self.src.ctx.store
        top = store.commit_log_max_offset
        yield GaugeMetricFamily(
            "txmq_commitlog_size_bytes",
            "Bytes in the commit log (its max offset - its min offset)",
            value=top - store.commit_log_min_offset,
        )
        yield GaugeMetricFamily(
            "txmq_commitlog_max_offset_bytes",
            "The commit log's end: bytes ever written",
            value=top,
        )
        yield GaugeMetricFamily(
            "rocketmq_storage_flush_behind_bytes",
            "Bytes written to the commit log and not fsynced yet",
            value=max(top - store.flushed_offset, 0),
        )
        yield histogram_family(
            "txmq_commitlog_flush_latency_seconds",
            "Time of one commit-log fsync",
            [],
            [([], self.src.tally.flush)],
        )
        yield CounterMetricFamily(
            "txmq_store_damage",
            "Damage the store found and went on without (txmq admin broker-info lists it)",
            value=store.damage.count,
        )
        yield CounterMetricFamily(
            "txmq_store_lost_messages",
            "Messages stored and then found gone at start-up (a segment deleted or cut)",
            value=store.damage.lost_messages,
        )
        yield GaugeMetricFamily(
            "txmq_store_disk_full",
            "1 while the store refuses writes for want of disk space",
            value=1 if store.disk.full else 0,
        )

    def _replication(self) -> Iterator[Metric]:
        d = self.src.replication()
        lag_bytes = GaugeMetricFamily(
            "txmq_replication_lag_bytes",
            "Commit-log bytes a slave is behind its master (on a master: each slave; on a "
            "slave: itself)",
            labels=["slave_id"],
        )
        lag_s = GaugeMetricFamily(
            "txmq_replication_lag_seconds",
            "How long since a slave had everything its master had (on a master, per slave)",
            labels=["slave_id"],
        )
        slaves = d.get("slaves")
        if isinstance(slaves, dict):
            for slave_id, lag in slaves.items():
                if isinstance(lag, dict):
                    lag_bytes.add_metric([str(slave_id)], _number(lag.get("lag_bytes")))
                    lag_s.add_metric([str(slave_id)], _number(lag.get("lag_s")))
            in_sync = d.get("in_sync")
            yield GaugeMetricFamily(
                "txmq_replication_in_sync_slaves",
                "Slaves in sync with this master",
                value=len(in_sync) if isinstance(in_sync, list) else 0,
            )
        elif "lag_bytes" in d:
            lag_bytes.add_metric([str(self.src.broker_id())], _number(d.get("lag_bytes")))
            yield GaugeMetricFamily(
                "txmq_replication_connected",
                "1 while this slave is connected to its master",
                value=1 if d.get("connected") else 0,
            )
        yield lag_bytes
        yield lag_s


def _number(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return 0.0


def registry_for(sources: MetricsSources) -> CollectorRegistry:
    """A registry of the broker's collector and the process's (CPU, memory, files)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(sources))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class _Fsync(Protocol):
    def __call__(self, lo: int, hi: int) -> None: ...


def time_flushes(store: MessageStore, dist: Dist) -> None:
    """Time each fsync of ``store``'s commit log into ``dist``.

    The store has no flush hook yet: this wraps its commit log's ``fsync_range`` on the
    instance (called by the flush thread, and at checkpoints and shutdown, only when there
    is something to flush).  A hook in broker/store/flush.py should replace it."""
    commit_log = store.commit_log
    fsync: _Fsync = commit_log.fsync_range

    def timed(lo: int, hi: int) -> None:
        began = time.perf_counter()
        try:
            fsync(lo, hi)
        finally:
            dist.observe(time.perf_counter() - began)

    commit_log.fsync_range = timed  # type: ignore[method-assign]


def timed_handler(handle: Handler, tally: Tally) -> Handler:
    """``handle`` (the request router's) timing each answer into ``tally.rpc``: at once, or
    when its future settles (SYNC flush, SYNC_MASTER); a long poll (a coroutine) is not
    timed, its wait is the point."""

    answered, clock, success = tally.answered, time.perf_counter, tally.rpc_dist
    #: request code -> its successes' histogram (tally.rpc[(code, "success")]), kept here
    #: so an answer costs one dict lookup, no tuple key and no calls but the clock's
    ok: dict[int, Dist] = {}
    bounds = RPC_BUCKETS_MS

    def timed(conn: Connection, frame: Frame) -> HandlerResult:
        began = clock()
        try:
            result = handle(conn, frame)
        except Exception as exc:
            answered(frame.code, _response(exc), began)
            raise
        if result is None or isinstance(result, _REPLIES):
            ms = (clock() - began) * 1000
            dist = ok.get(frame.code)
            if dist is None:
                dist = ok[frame.code] = success(frame.code, "success")
            dist.counts[bisect_left(bounds, ms)] += 1  # Dist.observe, inlined
            dist.total += ms
        elif isinstance(result, asyncio.Future):
            result.add_done_callback(partial(_time_settled, answered, frame.code, began))
        return result

    return timed


def _time_settled(
    answered: Callable[[int, str, float], None], code: int, began: float, fut: asyncio.Future[Any]
) -> None:
    answered(code, _settled(fut), began)


def _settled(fut: asyncio.Future[Any]) -> str:
    if fut.cancelled():
        return "cancelled"
    exc = fut.exception()
    return "success" if exc is None else _response(exc)


_responses: dict[type[BaseException], str] = {}


def _response(exc: BaseException) -> str:
    """``MessageTooLarge`` -> ``message_too_large`` (the response_code label)."""
    kind = type(exc)
    name = _responses.get(kind)
    if name is None:
        name = _responses[kind] = _snake(kind.__name__)
    return name


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
