"""A broker's registration with its name servers (RocketMQ's BrokerOuterAPI).

The broker registers with every name server it is given: right after it starts
listening, every ``register_interval_s`` (30 s), at once when a topic is created, changed
or deleted, and when a connection to a name server closes (a restarted name server has
an empty table).  A registration carries every topic a client may route to, and a
``data_version`` that changes with them (a name server takes the topics only when it
changed; otherwise the registration is a heartbeat).  A name server that is down does
not hold the broker up: one WARNING when it goes (and one line when it is back), and the
next attempt at the next interval.  On a clean stop the broker unregisters from each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio
import anyio.abc

from txmq.broker.state.config import BrokerConfig
from txmq.broker.state.topics import TopicConfig, TopicManager
from txmq.protocol.connection import Connection
from txmq.protocol.peer import RemotingClient
from txmq.protocol.wire import RegisterBroker, TopicConfigData, UnregisterBroker
from txmq.protocol.wire.errors import BrokerUnavailable, TxmqError

__all__ = ["NOT_REGISTERED_PREFIXES", "Registration", "is_registered_topic"]

log = logging.getLogger("txmq.broker")

#: topics only the broker itself reads and writes (half and op messages of transactions,
#: delayed messages): no client routes to them, so name servers are not told about them.
#: %RETRY% and %DLQ% topics are registered: consumers pull their retry topics by route.
NOT_REGISTERED_PREFIXES = ("RMQ_SYS_", "TXMQ_SYS_", "SCHEDULE_TOPIC_")
#: how long a clean stop waits for the name servers' answers to its unregistering
UNREGISTER_TIMEOUT_S = 3.0
#: a request to a name server, and connecting to one
REQUEST_TIMEOUT_S = 3.0


def is_registered_topic(name: str) -> bool:
    return not name.startswith(NOT_REGISTERED_PREFIXES)


@dataclass(slots=True, eq=False)
class _Link:
    """One name server, and how the last registration with it went."""

    address: str
    client: RemotingClient | None = None
    #: set to register now rather than at the next interval
    wake: anyio.Event | None = None
    #: None: not tried yet; True: registered; False: the last attempt failed
    ok: bool | None = None
    registered_once: bool = False
    first_attempt: anyio.Event | None = None


class Registration:
    """Keeps this broker registered with every name server of ``config.namesrv``."""

    def __init__(
        self,
        config: BrokerConfig,
        topics: TopicManager,
        address: Callable[[], str],
        *,
        ha_address: Callable[[], str] = str,
        grpc_address: Callable[[], str] = str,
        on_registered: Callable[[str, str], None] | None = None,
        broker_id: Callable[[], int] | None = None,
        epoch: Callable[[], int] = int,
    ) -> None:
        """``address`` gives the address clients are told (known once the broker
        listens), ``ha_address`` the broker's HA port; ``on_registered`` is told each
        name server's answer: the set's master's address and HA address; ``broker_id``
        the id to register under (default: the configured one; under a controller it
        follows the role)."""
        self.config = config
        self._broker_id = broker_id or (lambda: config.broker_id)
        self._epoch = epoch
        self.topics = topics
        self._address = address
        self._ha_address = ha_address
        self._grpc_address = grpc_address
        self._on_registered = on_registered
        # a restarted broker starts from another number, so that a name server that still
        # holds the old table takes the new one
        self.data_version = time.time_ns() // 1000
        self._links = [_Link(a) for a in config.namesrv_addresses]
        self._loops: anyio.abc.TaskGroup | None = None
        self._loops_done: anyio.Event | None = None
        self._closed: anyio.Event | None = None
        topics.on_change.append(self._topic_changed)
        topics.on_delete.append(self._topic_changed)

    @property
    def namesrv_addresses(self) -> list[str]:
        return [link.address for link in self._links]

    def registered_with(self) -> list[str]:
        """The name servers whose last registration succeeded."""
        return [link.address for link in self._links if link.ok]

    def request(self) -> RegisterBroker:
        cfg = self.config
        return RegisterBroker(
            cluster=cfg.cluster,
            broker_name=cfg.broker_name,
            broker_id=self._broker_id(),
            address=self._address(),
            ha_address=self._ha_address(),
            grpc_address=self._grpc_address(),
            data_version=self.data_version,
            topics=[_topic_data(t) for t in self.topics.all() if is_registered_topic(t.name)],
            epoch=self._epoch(),
        )

    def refresh(self) -> None:
        """Register with every name server now, as a new table (a topic or this broker's
        role changed)."""
        self.data_version += 1
        self.register_now()

    def register_now(self) -> None:
        """Register with every name server now (a heartbeat: nothing changed)."""
        for link in self._links:
            if link.wake is not None:
                link.wake.set()

    def _topic_changed(self, _: TopicConfig | str) -> None:
        self.refresh()

    # -- lifecycle --------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Register with every name server until :meth:`stop`; started (``tg.start``) once
        each name server has had its first attempt (a name server that is down does not
        hold the start up longer than a connect timeout)."""
        address = self._address()
        if address.rpartition(":")[0].strip("[]") in ("0.0.0.0", "::", ""):
            log.warning(
                "telling name servers this broker is at %s, which clients cannot reach: "
                "give --advertised-address HOST:PORT",
                address,
            )
        self._closed = anyio.Event()
        self._loops_done = anyio.Event()
        async with AsyncExitStack() as stack:
            for link in self._links:
                client = RemotingClient(
                    link.address,
                    connect_timeout=REQUEST_TIMEOUT_S,
                    security=self.config.peer_security(),
                    on_connect=[self._watch(link)],
                )
                link.client = await stack.enter_async_context(client)
                link.first_attempt = anyio.Event()
            try:
                async with anyio.create_task_group() as tg:
                    self._loops = tg
                    for link in self._links:
                        tg.start_soon(self._keep_registered, link)
                    with anyio.move_on_after(REQUEST_TIMEOUT_S + 1):
                        for link in self._links:
                            assert link.first_attempt is not None
                            await link.first_attempt.wait()
                    task_status.started()
            finally:
                self._loops_done.set()
            await self._closed.wait()  # the clients stay open for stop()'s unregistering

    async def stop(self) -> None:
        """Stop registering and unregister from every name server (at most a few
        seconds: a name server that does not answer is left to expire this broker)."""
        if self._loops is None or self._loops_done is None or self._closed is None:
            return
        self._loops.cancel_scope.cancel()
        await self._loops_done.wait()
        done: list[str] = []
        with anyio.move_on_after(UNREGISTER_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                for link in self._links:
                    tg.start_soon(self._unregister, link, done)
        if done:
            log.info("unregistered from name servers %s", ", ".join(sorted(done)))
        self._closed.set()

    # -- each name server -------------------------------------------------------------------

    def _watch(self, link: _Link) -> Callable[[Connection], Awaitable[None]]:
        async def hook(conn: Connection) -> None:
            conn.on_close.append(lambda _: self._connection_closed(link))

        return hook

    def _connection_closed(self, link: _Link) -> None:
        """A name server drops a broker whose connection closes: register again at once
        (only after a registration that worked, so that a peer that closes every
        connection gets one attempt per interval)."""
        if link.ok and link.wake is not None:
            link.wake.set()

    async def _keep_registered(self, link: _Link) -> None:
        interval = self.config.register_interval_s
        while True:
            link.wake = anyio.Event()  # a change while this registration is under way: again
            await self._register(link)
            if link.first_attempt is not None:
                link.first_attempt.set()
            with anyio.move_on_after(interval):
                await link.wake.wait()

    async def _register(self, link: _Link) -> None:
        assert link.client is not None
        request = self.request()
        try:
            answer = (await link.client.call(request, timeout=REQUEST_TIMEOUT_S)).header
        except TxmqError as exc:
            if link.ok is not False:
                log.warning(
                    "cannot register with name server %s (%s); trying again every %g s",
                    link.address,
                    _reason(exc),
                    self.config.register_interval_s,
                )
            link.ok = False
            return
        if not link.ok:
            log.info(
                "%s with name server %s as %s (id %d, cluster %s) at %s, %d topic(s)",
                "registered again" if link.registered_once else "registered",
                link.address,
                request.broker_name,
                request.broker_id,
                request.cluster,
                request.address,
                len(request.topics),
            )
        link.ok = link.registered_once = True
        if self._on_registered is not None and answer.master_address:
            self._on_registered(answer.master_address, answer.ha_address)

    async def _unregister(self, link: _Link, done: list[str]) -> None:
        assert link.client is not None
        cfg = self.config
        request = UnregisterBroker(
            cluster=cfg.cluster,
            broker_name=cfg.broker_name,
            broker_id=self._broker_id(),
            address=self._address(),
        )
        try:
            await link.client.call(request, timeout=UNREGISTER_TIMEOUT_S)
        except TxmqError as exc:
            log.info("could not unregister from name server %s (%s)", link.address, _reason(exc))
            return
        link.ok = None
        done.append(link.address)


def _topic_data(cfg: TopicConfig) -> TopicConfigData:
    return TopicConfigData(
        name=cfg.name, read_queue_nums=cfg.queue_nums, write_queue_nums=cfg.queue_nums
    )


def _reason(exc: TxmqError) -> BaseException:
    """Why a request to a name server failed (not "cannot connect to broker ...")."""
    if isinstance(exc, BrokerUnavailable) and exc.__cause__ is not None:
        return exc.__cause__
    return exc
