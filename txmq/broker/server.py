"""The broker process: listener, connections, background services, clean shutdown.

Run it with ``txmq broker start`` or embed it: ``async with Broker(config) as broker`` in an
anyio program, or :class:`EmbeddedBroker` (a background thread) from synchronous code.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from txmq.broker.admin import AdminService
from txmq.broker.consumption.pop import PopService
from txmq.broker.consumption.pulling import PullService
from txmq.broker.consumption.retry import RetryService
from txmq.broker.delivery.schedule import ScheduleMessageService
from txmq.broker.ha.info import with_replication
from txmq.broker.ha.replica import Replica
from txmq.broker.ha.replication import Replication
from txmq.broker.identity import claim_store
from txmq.broker.processor import Services, request_router
from txmq.broker.proxied import ProxyRequests
from txmq.broker.registration import Registration, is_registered_topic
from txmq.broker.sending import SendService
from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.context import Arrivals, BrokerContext, FlushAcks
from txmq.broker.state.dedupe import DedupeWindow
from txmq.broker.state.groups import (
    ConsumerManager,
    GroupService,
    ProducerManager,
    run_expiry_scan,
)
from txmq.broker.state.locks import LockService, RebalanceLockManager
from txmq.broker.state.offsets import ConsumerOffsetManager
from txmq.broker.state.stats import Tally, Throughput
from txmq.broker.state.subscriptions import SubscriptionGroupManager
from txmq.broker.state.topics import TopicManager
from txmq.broker.store import MessageStore
from txmq.broker.store.disk import is_disk_full
from txmq.broker.transactions.check import TransactionChecker
from txmq.broker.transactions.operator import OperatorDecisions
from txmq.broker.transactions.service import TransactionService
from txmq.observability.fmt import ms_time
from txmq.protocol.connection import Handler
from txmq.protocol.wire import RuntimeInfo
from txmq.security.acl.service import AclService
from txmq.server.serving import (
    Acceptor,
    EmbeddedServer,
    ListenerUnavailable,
    Stoppable,
    warn_if_exposed,
)

if TYPE_CHECKING:
    from txmq.broker.metrics import MetricsSources
    from txmq.server.grpc import GrpcEndpoint

__all__ = ["Broker", "EmbeddedBroker"]

log = logging.getLogger("txmq.broker")


def version() -> str:
    """txmq's version (its installed metadata's), as the broker reports it: looked up once
    (:func:`warm_version`, at start); "unknown" while it cannot be read (out of file
    descriptors, the broker still answers)."""
    from txmq.protocol.version import installed_version

    try:
        return installed_version()
    except OSError:
        return "unknown"


async def warm_version() -> None:
    """Read the version once, off the start's path (its metadata files are opened then,
    not when a broker short of file descriptors is asked)."""
    await anyio.to_thread.run_sync(version)


class Broker(Stoppable):
    """A txmq broker. ``await broker.serve()`` runs it until :meth:`request_stop`.

    ``listen=False``: it opens no port and serves its router to in-process clients only
    (:mod:`txmq.testing`); ``address`` then names it for them (HOST:PORT)."""

    def __init__(self, config: BrokerConfig, *, listen: bool = True, address: str = "") -> None:
        if not listen and not address:
            raise ValueError("a broker that does not listen needs the address it is served at")
        self.config = config
        self.listen = listen
        self._served_at = address
        config.store.mkdir(parents=True, exist_ok=True)
        self.store = MessageStore(config.store_config())
        self.topics = TopicManager(
            config.store / "config" / "topics.json",
            auto_create=config.auto_create_topic,
            default_queue_nums=config.default_queue_nums,
        )
        self.offsets = ConsumerOffsetManager(config.store / "config" / "offsets.json")
        self.consumers = ConsumerManager()
        self.topics.on_change.append(lambda cfg: self.consumers.topic_changed(cfg.name))
        self.producers = ProducerManager()
        self.locks = RebalanceLockManager(config.lock_expiry_s)
        self.arrivals = Arrivals()
        #: access control (--acl FILE): None when off
        self.guard = guard = config.guard(f"broker {config.broker_name}")
        #: per topic and group, for the metrics endpoint (counted only while metrics are on)
        tally = Tally() if config.metrics_port != 0 else None
        #: this broker's role in its set, its epochs and the HA service its slaves copy from
        #: (what the metadata slaves copy and the controller link are replication's, built
        #: below from the context: reached late, when a slave asks)
        self.replica = replica = Replica(
            config,
            self.store,
            self.topics,
            self.offsets,
            metadata=lambda: self.replication.metadata.take(),
            on_caught_up=lambda: self.replication.caught_up(),
            guard=guard,
        )
        ctx = self.context = BrokerContext(
            config=config,
            store=self.store,
            topics=self.topics,
            offsets=self.offsets,
            consumers=self.consumers,
            producers=self.producers,
            locks=self.locks,
            arrivals=self.arrivals,
            acks=FlushAcks(self.store, config, gate=replica),
            replica=replica,
            groups=SubscriptionGroupManager(config.store / "config" / "groups.json"),
            dedupe=DedupeWindow(config.dedupe_window_s, config.dedupe_max_entries)
            if config.dedupe_window_s > 0
            else None,
            guard=guard,
            throughput=Throughput(tally=tally),
        )
        self.schedule = ScheduleMessageService(ctx)
        self.transactions = TransactionService(ctx, self.schedule)
        self.transaction_checker = TransactionChecker(ctx, self.transactions)
        self.decisions = OperatorDecisions(ctx, self.transactions)
        self.services = Services(
            sending=SendService(ctx, self.schedule, self.transactions),
            pulling=PullService(ctx),
            groups=GroupService(self.consumers, self.producers, self.topics),
            locks=LockService(self.locks),
            retry=RetryService(ctx, self.schedule),
            transactions=self.transactions,
            checker=self.transaction_checker,
            decisions=self.decisions,
            admin=AdminService(ctx, self.runtime_info),
            acl=AclService(guard, f"broker {config.broker_name}"),
        )
        #: RocketMQ 5's pop consumption (the gRPC endpoint's ReceiveMessage and acks, and
        #: a gRPC proxy's POP_MESSAGE requests)
        self.pop = PopService(ctx, self.services.retry)
        proxied = ProxyRequests(self.services.sending, self.pop, ctx.groups)
        self.router = request_router(self.services, guard, proxied)
        #: the RocketMQ 5 gRPC endpoint, once started (txmq.server.grpc)
        self.grpc: GrpcEndpoint | None = None
        self.replication = Replication(
            config,
            ctx,
            replica,
            self.schedule,
            self.transactions,
            lambda: self.address,
            self,
            on_change=self._role_changed,
            rediscover=self._register_now,
        )
        self.registration: Registration | None = None
        if config.namesrv_addresses:
            self.registration = Registration(
                config,
                self.topics,
                lambda: self.address,
                ha_address=lambda: self.replication.ha_address,
                grpc_address=lambda: self.grpc.address() if self.grpc is not None else "",
                on_registered=self.replication.registered,
                broker_id=lambda: self.replication.registered_id,
                epoch=lambda: self.replication.role.epoch,
            )
        self._tg: anyio.abc.TaskGroup | None = None
        self._duties: anyio.CancelScope | None = None
        handle: Handler = self.router.handle
        #: the port /metrics is served on, once started (0: off)
        self.metrics_port = 0
        if tally is not None:  # metrics on (prometheus_client is imported only then)
            from txmq.broker.metrics import time_flushes, timed_handler

            handle = timed_handler(handle, tally)
            time_flushes(self.store, tally.flush)
        self.acceptor = Acceptor(
            handle,
            max_frame_size=config.max_frame_size,
            limits=config.connection_limits(),
            log_to="txmq.broker",
            tls=config.server_ssl_context(),
        )
        self.connections = self.acceptor.connections
        self.port = config.port
        self.started_at = 0.0

    def _role_changed(self) -> None:
        """This broker's role or registered id changed: the name servers are told."""
        if self.registration is not None:
            self.registration.refresh()

    def _register_now(self) -> None:
        """Register with the name servers now (their answer names the set's master)."""
        if self.registration is not None:
            self.registration.register_now()

    @property
    def address(self) -> str:
        """Where clients reach this broker (advertised_address, else host:port; a broker
        that does not listen: the address it is served at)."""
        if not self.listen:
            return self._served_at
        return self.config.advertised_address or f"{self.config.host}:{self.port}"

    # -- lifecycle --------------------------------------------------------------------------

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[Broker] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._stop = anyio.Event()
        began = time.monotonic()
        self.store.start()
        try:
            claim_store(self.config)
        except BaseException:
            self.store.shutdown()
            raise
        rec = self.store.last_recovery
        log.info(
            "store %s opened in %.0f ms (previous stop %s; re-dispatched %d records from offset %d,"
            " truncated %d bytes)",
            self.config.store,
            (time.monotonic() - began) * 1000,
            "clean" if rec.clean else "NOT clean",
            rec.redispatched,
            rec.scanned_from,
            rec.truncated_bytes,
        )
        try:
            self.store.disk.check()  # a disk already full: refuse writes from the start
            if self.replication.role.is_master:
                self.transactions.recover()
                self._read_dedupe_window()
            listener = await self._listener()
        except BaseException:
            self.store.shutdown()
            raise
        self.started_at = time.time()
        try:
            async with AsyncExitStack() as stack:
                if listener is not None:  # (closed after the task group ends)
                    await stack.enter_async_context(listener)
                tg = await stack.enter_async_context(anyio.create_task_group())
                if listener is not None:
                    self.acceptor.serve(listener, tg)
                tg.start_soon(self._offset_persister)
                tg.start_soon(self._sample_throughput)
                tg.start_soon(self._disk_watch)
                if self.guard is not None:
                    tg.start_soon(self.guard.watch)
                await tg.start(self.pop.run)
                self._tg = tg
                await tg.start(self.replication.run)
                if self.replication.role.is_master:
                    await self._start_duties()
                expiry = self.config.consumer_channel_expiry_s
                tg.start_soon(run_expiry_scan, self.consumers, self.producers, expiry)
                tg.start_soon(warm_version)
                await self._start_metrics(tg)
                log.info(
                    "broker %s on %s (flush %s; metrics %s)",
                    "listening" if listener is not None else "serving in process",
                    self.address,
                    self.config.flush.value,
                    f"on {self.metrics_url}" if self.metrics_url else "off",
                )
                await self._start_grpc()
                if self.registration is not None:
                    await tg.start(self.registration.run)
                task_status.started(self)
                await self._stop.wait()
                await self._stop_grpc()
                await self.replication.hand_over()
                await self.replication.leave()
                if self.registration is not None:
                    # clients stop routing here before the listener closes
                    await self.registration.stop()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_grpc()
            self._shutdown()

    async def _listener(self) -> anyio.abc.Listener[anyio.abc.SocketStream] | None:
        """The TCP listener (None: this broker does not listen)."""
        if not self.listen:
            return None
        listener = await anyio.create_tcp_listener(
            local_host=self.config.host, local_port=self.config.port, reuse_port=False
        )
        self.port = listener.extra(SocketAttribute.local_port)
        warn_if_exposed(
            "broker",
            self.config.host,
            tls=self.config.tls_cert is not None,
            acl=self.guard is not None,
        )
        return listener

    # -- the RocketMQ 5 gRPC endpoint -------------------------------------------------------

    async def _start_grpc(self) -> None:
        """Serve the gRPC protocol unless it is off (grpc_port 0).  On the default port a
        missing extra or a taken port only turn it off (logged); a chosen port must work."""
        chosen = self.config.grpc_port
        if chosen == 0:
            return
        try:
            from txmq.broker.grpc_core import broker_core
            from txmq.server.grpc import GrpcEndpoint
        except ImportError as exc:
            why = ListenerUnavailable(
                f"the gRPC endpoint needs the txmq[grpc] extra ({exc}): pip install "
                "'txmq[grpc]', or turn it off with --grpc-port 0"
            )
            if chosen > 0:
                raise why from None
            log.info("gRPC endpoint off: %s", why)
            return
        endpoint = GrpcEndpoint(broker_core(self.context, self.services, self.pop))
        try:
            await endpoint.start()
        except ListenerUnavailable as exc:
            if chosen > 0:
                raise
            log.warning("gRPC endpoint off: %s", exc)
            return
        self.grpc = endpoint

    async def _stop_grpc(self) -> None:
        endpoint, self.grpc = self.grpc, None
        if endpoint is not None:
            await endpoint.stop()

    # -- Prometheus metrics (broker/metrics.py) ---------------------------------------------

    async def _start_metrics(self, tg: anyio.abc.TaskGroup) -> None:
        sources = self.metrics_sources()
        if sources is None:
            return
        from txmq.broker.metrics import registry_for
        from txmq.broker.metrics_endpoint import start_metrics

        registry = registry_for(sources)
        self.metrics_port = await start_metrics(
            tg, registry, self.config.host, self.config.metrics_port
        )

    @property
    def metrics_url(self) -> str:
        """Where ``/metrics`` is served ("" while metrics are off or not started)."""
        if not self.metrics_port:
            return ""
        from txmq.broker.metrics_endpoint import metrics_url

        return metrics_url(self.config.host, self.metrics_port)

    def metrics_sources(self) -> MetricsSources | None:
        """What the metrics read (None: metrics are off)."""
        tally = self.context.throughput.tally
        if tally is None:
            return None
        from txmq.broker.metrics import MetricsSources

        return MetricsSources(
            ctx=self.context,
            tally=tally,
            version=version(),
            pending=lambda: self.transactions.pending.values(),
            pop_inflight=self.pop.inflight,
            replication=self.replication.describe,
            broker_id=lambda: self.replication.registered_id,
            connections=lambda: len(self.connections),
        )

    # -- what only the master runs (broker.replication.MasterDuties) -----------------------

    async def _start_duties(self) -> None:
        assert self._tg is not None
        scope = self._duties = anyio.CancelScope()

        async def duties(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            started = False
            with scope:
                async with anyio.create_task_group() as tg:
                    await tg.start(self.schedule.run)
                    await tg.start(self.transaction_checker.run)
                    task_status.started()
                    started = True
            if not started:
                # stopped before they had started (the broker stops, or hands the role on,
                # while it is being promoted): nothing runs, and the promotion just ends
                task_status.started()

        await self._tg.start(duties)

    async def became_master(self) -> None:
        """Promoted: take the old master's delay-level and transaction-check offsets (its
        metadata, copied), find the undecided halves in the log, and run the schedule and
        the check-back."""
        self._topics_of_the_log()
        self._read_dedupe_window()
        self.schedule.reload()
        self.transactions.recover()
        await self._start_duties()

    def _read_dedupe_window(self) -> None:
        """Before the first send as the master: the ids stored in the last
        ``dedupe_window_s``, from the key index (a slave's too: built from its copy)."""
        window = self.context.dedupe
        if window is None:
            return
        began = time.monotonic()
        loaded = window.load(self.store)
        log.info(
            "dedupe window: %d key hashes of the last %.0f s loaded from the key index in %.0f ms",
            loaded,
            self.config.dedupe_window_s,
            (time.monotonic() - began) * 1000,
        )

    def _topics_of_the_log(self) -> None:
        """A topic whose messages this broker copied before it copied the topic itself
        (created on the old master moments before it died) gets its config now."""
        for topic, queues in self.store.queue_offsets().items():
            if self.topics.get(topic) is None and is_registered_topic(topic):
                nums = max(max(queues) + 1, self.config.default_queue_nums)
                log.warning("topic %s is in the log but not in the topic table: created", topic)
                self.topics.create_or_update(topic, nums)

    async def became_slave(self) -> None:
        if self._duties is not None:
            self._duties.cancel()
            self._duties = None

    def _shutdown(self) -> None:
        self._save("consumer offsets", lambda: self.offsets.persist(force=True))
        if self.replication.role.is_master:  # a slave's file is its master's, copied
            self._save("delay-level offsets", lambda: self.schedule.persist(force=True))
        transactions = self.transaction_checker.snapshot(force=True)
        self.store.shutdown()
        self._save("transaction offsets", lambda: self.transaction_checker.write(transactions))
        log.info("broker stopped; store flushed through offset %d", self.store.flushed_offset)

    def _save(self, what: str, save: Callable[[], None]) -> None:
        """At shutdown: ``save()``; on a full disk the older file stays (one line)."""
        try:
            save()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            log.warning("the disk is full: the %s could not be saved; the older ones stay", what)

    async def _sample_throughput(self) -> None:
        while True:
            await anyio.sleep(5)
            self.context.throughput.sample()

    async def _offset_persister(self) -> None:
        while True:
            await anyio.sleep(self.config.offset_persist_interval_s)
            try:
                await anyio.to_thread.run_sync(self.offsets.persist)
            except OSError as exc:
                if not self.store.disk.absorb(exc):  # a full disk is logged once, there
                    log.exception("persisting consumer offsets failed")

    async def _disk_watch(self) -> None:
        """Refuse writes while the store's disk is used over disk_max_used_ratio, take
        them again below it (a write that fails for want of space refuses them at once)."""
        while True:
            await anyio.sleep(self.config.disk_check_interval_s)
            await anyio.to_thread.run_sync(self.store.disk.check)

    def runtime_info(self) -> RuntimeInfo:
        put_tps, get_tps = self.context.throughput.rates()
        info = RuntimeInfo(
            version=version(),
            address=self.address,
            pid=os.getpid(),
            flush=self.config.flush.value,
            store=str(self.config.store),
            uptime_s=round(time.time() - self.started_at, 1),
            connections=len(self.connections),
            topics=len(self.topics.all()),
            commit_log_min_offset=self.store.commit_log_min_offset,
            commit_log_max_offset=self.store.commit_log_max_offset,
            flushed_offset=self.store.flushed_offset,
            pending_transactions=len(self.transactions.pending),
            put_tps=round(put_tps, 1),
            get_tps=round(get_tps, 1),
            put_total=self.context.throughput.put,
            get_total=self.context.throughput.got,
            cluster=self.config.cluster,
            broker_name=self.config.broker_name,
            namesrv=list(self.config.namesrv_addresses),
            broker_id=self.config.broker_id,
            store_damage_count=self.store.damage.count,
            store_lost_messages=self.store.damage.lost_messages,
            store_damage=[
                f"{ms_time(d.found_at)} {d.describe()}" for d in self.store.damage.entries()
            ],
        )
        return with_replication(info, self.replication)


class EmbeddedBroker(EmbeddedServer[Broker]):
    """A broker running in a background thread with its own event loop."""

    what = "broker"

    def __init__(self, config: BrokerConfig, *, listen: bool = True, address: str = "") -> None:
        super().__init__(lambda: Broker(config, listen=listen, address=address))
        self.config = config

    @property
    def broker(self) -> Broker | None:
        return self.server
