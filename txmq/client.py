"""The base of every txmq client: broker connection, lifecycle and the topic-route cache."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Self

import anyio

from txmq.errors import BrokerUnavailable, TxmqError
from txmq.remoting import Connection, Handler, RemotingClient
from txmq.wire import DEFAULT_MAX_FRAME_SIZE, GetRouteInfo, Heartbeat, Request, WithBody
from txmq.wire.base import R

__all__ = ["DEFAULT_ADDRESS", "BrokerClient", "default_address"]

DEFAULT_ADDRESS = "127.0.0.1:10911"

log = logging.getLogger("txmq.client")


def default_address() -> str:
    """``$TXMQ_BROKER_ADDRESS`` or 127.0.0.1:10911."""
    return os.environ.get("TXMQ_BROKER_ADDRESS", DEFAULT_ADDRESS)


class BrokerClient:
    """Connection to one broker, started with ``start()``/``stop()`` or ``async with``.

    Runs on asyncio (which SQLAlchemy's async engines need too).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        request_timeout: float = 3.0,
        connect_timeout: float = 3.0,
        route_ttl: float = 30.0,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        handler: Handler | None = None,
    ) -> None:
        self.address = address or default_address()
        self.request_timeout = request_timeout
        self.route_ttl = route_ttl
        self.remoting = RemotingClient(
            self.address,
            handler,
            connect_timeout=connect_timeout,
            max_frame_size=max_frame_size,
        )
        self._routes: dict[str, tuple[int, float]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self.heartbeat_interval = 30.0
        self.remoting.on_connect.append(self._announce)
        self._stop_event: anyio.Event | None = None
        self._lifetime: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self._lifetime is not None

    async def start(self) -> None:
        """Connect and start background work. Any task may later call :meth:`stop`."""
        if self._lifetime is not None:
            return
        started = anyio.Event()
        stop = self._stop_event = anyio.Event()

        async def lifetime() -> None:
            try:
                async with self.remoting, anyio.create_task_group() as tg:
                    self._tg = tg
                    started.set()
                    await stop.wait()
                    tg.cancel_scope.cancel()
            finally:
                self._tg = None
                started.set()

        # The client's task group lives in a task of its own, so that start() and stop()
        # may be called from different tasks (a web framework's startup and shutdown hooks).
        self._lifetime = asyncio.get_running_loop().create_task(lifetime())
        await started.wait()
        if self._lifetime.done():
            task, self._lifetime = self._lifetime, None
            task.result()
        try:
            await self._on_start()
        except BaseException:
            await self.stop()
            raise

    async def _on_start(self) -> None:
        """Connect eagerly so that a wrong address fails at start, not at first use."""
        await self.remoting.connection()

    async def _on_stop(self) -> None:
        return None

    async def stop(self) -> None:
        task, self._lifetime = self._lifetime, None
        if task is None:
            return
        try:
            await self._on_stop()
        finally:
            if self._stop_event is not None:
                self._stop_event.set()
            await task

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- heartbeats (clients that register with the broker: consumers, transactional producers)

    def _heartbeat_request(self) -> Heartbeat | None:
        """What this client tells the broker about itself; None: it sends no heartbeats."""
        return None

    async def _announce(self, conn: Connection) -> None:
        # a (re)connected broker learns who we are before anything else on this connection
        heartbeat = self._heartbeat_request()
        if heartbeat is not None:
            conn.send_oneway(heartbeat)

    async def _heartbeat(self) -> None:
        heartbeat = self._heartbeat_request()
        if heartbeat is not None:
            await self.call(heartbeat)

    async def _heartbeat_loop(self) -> None:
        """Heartbeat every ``heartbeat_interval`` seconds (started by subclasses that need it)."""
        while True:
            await anyio.sleep(self.heartbeat_interval)
            try:
                await self._heartbeat()
            except TxmqError as exc:
                log.warning("heartbeat failed: %s", exc)

    def _task_group(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise BrokerUnavailable("client is not started: call start() or use 'async with'")
        return self._tg

    async def call(
        self, request: Request[R], body: bytes = b"", *, timeout: float | None = None
    ) -> R:
        """Send a typed request; its typed answer (error answers raise)."""
        return (await self.call_with_body(request, body, timeout=timeout)).header

    async def call_with_body(
        self, request: Request[R], body: bytes = b"", *, timeout: float | None = None
    ) -> WithBody[R]:
        """Send a typed request; its typed answer and the answer's body (records)."""
        self._task_group()
        return await self.remoting.call(
            request, body, timeout=self.request_timeout if timeout is None else timeout
        )

    async def queue_nums(self, topic: str, *, create: bool = False, refresh: bool = False) -> int:
        """How many queues ``topic`` has (cached for ``route_ttl`` seconds)."""
        cached = self._routes.get(topic)
        now = time.monotonic()
        if cached is not None and not refresh and now - cached[1] < self.route_ttl:
            return cached[0]
        nums = (await self.call(GetRouteInfo(topic=topic, create=create))).queue_nums
        self._routes[topic] = (nums, now)
        return nums

    async def queues(self, topic: str) -> list[int]:
        return list(range(await self.queue_nums(topic)))
