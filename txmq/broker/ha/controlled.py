"""A broker under a controller: heartbeat, and take the role the controller gives.

Every ``controller_heartbeat_interval_s`` (0.5 s; every 0.05 s while an election runs, and
while a slave hears nothing from its master) the broker tells the controller its log's end
and newest epoch; the answer says who the set's master is.  Told it is the master of a new
epoch, the broker promotes itself; told another is, it follows that one
(cutting back a tail first, if it was the master).  A master's lease is renewed from the
moment the heartbeat was *sent* (see :mod:`txmq.broker.ha.role`).  A controller that does
not answer renews nothing: the master stops acknowledging writes when its lease ends.

Controllers on etcd: only the leader decides; a follower's answer names the leader, which
the broker asks at once (also when it was not among the addresses it was given) and keeps
asking while it answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import anyio

from txmq.protocol.peer import RemotingClient
from txmq.protocol.wire import ControllerAnswer, ControllerHeartbeat
from txmq.protocol.wire.errors import TxmqError
from txmq.security.client import ClientSecurity

__all__ = ["ControllerLink"]

log = logging.getLogger("txmq.broker.ha")

#: how often a broker heartbeats while its set has no master
ELECTION_INTERVAL_S = 0.05


class ControllerLink:
    def __init__(
        self,
        addresses: tuple[str, ...],
        interval_s: float,
        heartbeat: Callable[[], ControllerHeartbeat],
        apply: Callable[[ControllerAnswer, float], Awaitable[None]],
        security: ClientSecurity | None = None,
        urgent: Callable[[], bool] = lambda: False,
    ) -> None:
        """``security``: how to reach the controllers (the broker's peer_security());
        ``urgent``: heartbeat every ELECTION_INTERVAL_S while it says so (a slave that
        lost its master: an election is coming, and the controller waits for its report)."""
        self.addresses = addresses
        self.security = security
        self.interval_s = interval_s
        self._heartbeat = heartbeat
        self._apply = apply
        self._urgent = urgent
        self._which = 0
        self.last_answer: ControllerAnswer | None = None
        self._failing = False
        self._poked = anyio.Event()

    @property
    def failing(self) -> bool:
        """No controller answered the last heartbeat (this broker may be cut from them)."""
        return self._failing

    def poke(self) -> None:
        """Heartbeat again now (the role just changed: tell the controller at once)."""
        self._poked.set()

    async def run(self) -> None:
        async with AsyncExitStack() as stack:
            self._stack = stack
            clients = [await self._client(a) for a in self.addresses]
            while True:
                began = time.monotonic()
                self._poked = anyio.Event()
                await self._once(clients)
                interval = self.interval_s
                last = self.last_answer
                electing = last is not None and (last.electing or last.master_id < 0)
                if electing or self._urgent():
                    interval = min(interval, ELECTION_INTERVAL_S)  # learn the winner soon
                with anyio.move_on_after(max(interval - (time.monotonic() - began), 0.01)):
                    await self._poked.wait()

    async def _client(self, address: str) -> RemotingClient:
        return await self._stack.enter_async_context(
            RemotingClient(address, connect_timeout=1.0, security=self.security)
        )

    async def _once(self, clients: list[RemotingClient]) -> None:
        order = [(self._which + i) % len(clients) for i in range(len(clients))]
        tried: set[int] = set()
        while order:
            index = order.pop(0)
            if index in tried:
                continue
            tried.add(index)
            client = clients[index]
            sent_at = time.monotonic()
            try:
                answer = (await client.call(self._heartbeat(), timeout=self.interval_s * 2)).header
            except TxmqError as exc:
                if not self._failing:
                    log.warning("controller %s does not answer (%s)", client.address, exc)
                continue
            if answer.follower:  # controllers on etcd: ask the leader next
                leader = answer.leader
                if leader:
                    known = [i for i, c in enumerate(clients) if c.address == leader]
                    if not known:
                        clients.append(await self._client(leader))
                        known = [len(clients) - 1]
                    order.insert(0, known[0])
                continue
            self._which = index
            if self._failing:
                log.info("controller %s answers again", client.address)
            self._failing = False
            self.last_answer = answer
            await self._apply(answer, sent_at)
            return
        self._failing = True
