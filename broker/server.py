"""The broker process: listener, connections, background services, clean shutdown.

Run it with ``txmq broker start`` or embed it: ``async with Broker(config) as broker`` in an
anyio program, or :class:`EmbeddedBroker` (a background thread) from synchronous code.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import AsyncExitStack
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from txmq.broker.admin import AdminService
from txmq.broker.config import BrokerConfig
from txmq.broker.consumers import (
    ConsumerManager,
    GroupService,
    ProducerManager,
    run_expiry_scan,
)
from txmq.broker.context import Arrivals, BrokerContext, FlushAcks
from txmq.broker.locks import LockService, RebalanceLockManager
from txmq.broker.offsets import ConsumerOffsetManager
from txmq.broker.processor import Services, request_router
from txmq.broker.pulling import PullService
from txmq.broker.retry import RetryService
from txmq.broker.schedule import ScheduleMessageService
from txmq.broker.sending import SendService
from txmq.broker.store import MessageStore
from txmq.broker.topics import TopicManager
from txmq.broker.transaction import TransactionService
from txmq.broker.transaction_check import TransactionChecker
from txmq.remoting import Connection
from txmq.wire import RuntimeInfo

__all__ = ["Broker", "EmbeddedBroker"]

log = logging.getLogger("txmq.broker")

VERSION = "0.1.0"


class Broker:
    """A txmq broker. ``await broker.serve()`` runs it until :meth:`request_stop`."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
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
        ctx = self.context = BrokerContext(
            config=config,
            store=self.store,
            topics=self.topics,
            offsets=self.offsets,
            consumers=self.consumers,
            producers=self.producers,
            locks=self.locks,
            arrivals=self.arrivals,
            acks=FlushAcks(self.store, config),
        )
        self.schedule = ScheduleMessageService(ctx)
        self.transactions = TransactionService(ctx)
        self.transaction_checker = TransactionChecker(ctx, self.transactions)
        self.services = Services(
            sending=SendService(ctx, self.schedule, self.transactions),
            pulling=PullService(ctx),
            groups=GroupService(self.consumers, self.producers, self.topics),
            locks=LockService(self.locks),
            retry=RetryService(ctx, self.schedule),
            transactions=self.transactions,
            checker=self.transaction_checker,
            admin=AdminService(ctx, self.runtime_info),
        )
        self.router = request_router(self.services)
        self.connections: set[Connection] = set()
        self.port = config.port
        self.started_at = 0.0
        self._stop: anyio.Event | None = None
        self._stack: AsyncExitStack | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    # -- lifecycle --------------------------------------------------------------------------

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[Broker] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._stop = anyio.Event()
        began = time.monotonic()
        self.store.start()
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
            self.transactions.recover()
            listener = await anyio.create_tcp_listener(
                local_host=self.config.host, local_port=self.config.port, reuse_port=False
            )
        except BaseException:
            self.store.shutdown()
            raise
        self.port = listener.extra(SocketAttribute.local_port)
        self.started_at = time.time()
        try:
            async with listener, anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, self._serve_stream, tg)
                tg.start_soon(self._offset_persister)
                await tg.start(self.schedule.run)
                await tg.start(self.transaction_checker.run)
                expiry = self.config.consumer_channel_expiry_s
                tg.start_soon(run_expiry_scan, self.consumers, self.producers, expiry)
                log.info("broker listening on %s (flush %s)", self.address, self.config.flush.value)
                task_status.started(self)
                await self._stop.wait()
                tg.cancel_scope.cancel()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self.offsets.persist(force=True)
        self.schedule.persist(force=True)
        transactions = self.transaction_checker.snapshot(force=True)
        self.store.shutdown()
        self.transaction_checker.write(transactions)
        log.info("broker stopped; store flushed through offset %d", self.store.flushed_offset)

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def __aenter__(self) -> Broker:
        stack = AsyncExitStack()
        tg = await stack.enter_async_context(anyio.create_task_group())
        await tg.start(self.serve)
        self._stack = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.request_stop()
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None

    async def _serve_stream(self, stream: anyio.abc.SocketStream) -> None:
        try:
            peer = stream.extra(SocketAttribute.remote_address)
            name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        except Exception:
            name = "?"
        conn = Connection(
            stream, self.router.handle, max_frame_size=self.config.max_frame_size, name=name
        )
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)

    async def _offset_persister(self) -> None:
        while True:
            await anyio.sleep(self.config.offset_persist_interval_s)
            try:
                await anyio.to_thread.run_sync(self.offsets.persist)
            except OSError:
                log.exception("persisting consumer offsets failed")

    def runtime_info(self) -> RuntimeInfo:
        return RuntimeInfo(
            version=VERSION,
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
        )


class EmbeddedBroker:
    """A broker running in a background thread with its own event loop."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.broker: Broker | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._portal_stop: Any = None

    @property
    def address(self) -> str:
        assert self.broker is not None, "broker not started"
        return self.broker.address

    def start(self, timeout: float = 60.0) -> EmbeddedBroker:
        self._thread = threading.Thread(target=self._run, name="txmq-broker", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("embedded broker did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        async def main() -> None:
            broker = Broker(self.config)
            token = anyio.lowlevel.current_token()
            self._portal_stop = lambda: anyio.from_thread.run_sync(broker.request_stop, token=token)
            async with anyio.create_task_group() as tg:
                await tg.start(broker.serve)
                self.broker = broker
                self._ready.set()

        try:
            anyio.run(main)
        except BaseException as exc:
            self._error = exc
            if not self._ready.is_set():
                self._ready.set()
            else:
                log.exception("embedded broker failed")

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        if self._portal_stop is not None and self._thread.is_alive():
            try:
                self._portal_stop()
            except RuntimeError:
                pass
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
