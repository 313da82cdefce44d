"""Controllers on etcd: any number run, one leads, and a deposed leader can write nothing.

Each controller campaigns for one key, ``<prefix>/controller/leader``, created only if it
is absent (an etcd transaction) and bound to an etcd *lease* of ``ttl_s`` seconds that the
controller keeps alive (RocketMQ 5 runs its controllers on DLedger or jRaft; txmq leaves
the consensus to etcd).  The key's value is the controller's address, so that the others
can tell brokers whom to ask.  The holder leads:

* **Its writes are fenced.**  Every broker set's state (epoch, master, sync state set,
  history) is one key, ``<prefix>/controller/sets/<broker set>``, written only in an etcd
  transaction that compares the leader key's create revision with the one this controller
  created: once its lease expired (or the key was deleted) the comparison fails and
  nothing is written — :class:`Deposed`.
* **It stops acting before etcd could let another lead.**  It counts its leadership as
  valid until the lease's length (``ttl_s``, or the longer one etcd granted) after it
  *sent* the last keep-alive etcd answered: etcd expires the
  key no earlier than that, and only then may another controller create it.  A new leader
  reads every set's state from etcd when it takes over.

A follower watches the key (a poll of it every ``WATCH_POLL_S``, 0.1 s) and campaigns as
soon as it is gone.  The etcd members are tried in turn: one that is down or cut off costs a
reconnection to the next.

aetcd (asyncio, etcd's v3 gRPC API) is imported only here, when a controller is given
``--etcd``: ``pip install 'txmq[etcd]'``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from txmq.protocol.wire.errors import TxmqError

__all__ = ["Deposed", "EtcdLeadership", "EtcdUnavailable", "parse_endpoints"]

log = logging.getLogger("txmq.controller")

T = TypeVar("T")

#: how long one etcd request may take before the next member is tried
REQUEST_TIMEOUT_S = 1
#: how often a follower reads the leader key (a serializable read; ten a second is
#: nothing to etcd): a leader that died is followed this much later than its key expired
WATCH_POLL_S = 0.1


class Deposed(TxmqError):
    """This controller no longer leads: its write was refused (its leader key is gone)."""

    retriable = True


class EtcdUnavailable(TxmqError):
    """No etcd member answers."""

    retriable = True


def parse_endpoints(text: str) -> tuple[str, ...]:
    """``"http://h1:2379,h2:2379"`` -> ``("h1:2379", "h2:2379")``; ValueError with what
    is wrong."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        for scheme in ("http://", "https://"):
            part = part.removeprefix(scheme)
        host, sep, port = part.rstrip("/").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {part!r} is not HOST:PORT (e.g. 127.0.0.1:2379)")
        out.append(f"{host}:{port}")
    if not out:
        raise ValueError("--etcd needs at least one endpoint, HOST:PORT[,HOST:PORT...]")
    return tuple(out)


class EtcdLeadership:
    """One controller's candidacy and, while it leads, its fenced writes."""

    def __init__(
        self,
        endpoints: Sequence[str],
        address: str,
        *,
        prefix: str = "/txmq",
        ttl_s: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``address``: where brokers reach this controller (the leader key's value)."""
        if not endpoints:
            raise ValueError("no etcd endpoint")
        if ttl_s < 1:
            raise ValueError("the etcd lease must last at least 1 s")
        self.endpoints = tuple(endpoints)
        self.address = address
        self.prefix = prefix.rstrip("/")
        self.ttl_s = ttl_s
        #: the lease etcd granted (ttl_s, or its shortest if that is longer)
        self._ttl = ttl_s
        self._clock = clock
        self.key = f"{self.prefix}/controller/leader".encode()
        self.sets_prefix = f"{self.prefix}/controller/sets/".encode()
        #: the leader's address as last read ("" : none known)
        self.leader_address = ""
        self._which = 0
        self._client: Any = None
        self._revision = 0  # the create revision of our leader key (0: not leading)
        self._valid_until = 0.0
        self._lease: Any = None
        #: a campaign won: (the leader key's create revision, until when it holds)
        self._won = (0, 0.0)

    # -- what the controller asks ----------------------------------------------------------

    @property
    def valid_until(self) -> float:
        """Until when (this controller's clock) it may act as the leader: the granted
        lease's length after it sent the last keep-alive etcd answered (0: it does not
        lead)."""
        return self._valid_until if self._revision > 0 else 0.0

    @property
    def leading(self) -> bool:
        """Whether this controller may act as the leader now."""
        return self._revision > 0 and self._clock() < self._valid_until

    async def save(self, entries: Mapping[str, bytes]) -> None:
        """Write each broker set's state (name -> value) in one transaction that holds only
        while this controller's leader key is the one it created; :class:`Deposed` if not."""
        if not self.leading:
            raise Deposed("this controller's leadership ran out before it could save")
        client = self._client
        tx = client.transactions
        try:
            ok, _ = await _bounded(
                client.transaction(
                    compare=[tx.create(self.key) == self._revision],
                    success=[tx.put(self.sets_prefix + n.encode(), v) for n, v in entries.items()],
                    failure=[],
                ),
                REQUEST_TIMEOUT_S * 2,
            )
        except Exception as exc:  # the etcd member went, or the write timed out
            self._step_down(f"etcd did not take its write ({_one_line(exc)})")
            raise Deposed(f"the state could not be saved in etcd ({_one_line(exc)})") from None
        if not ok:
            self._step_down("its leader key is gone (its etcd lease expired)")
            raise Deposed("another controller leads: this one's leader key is gone")

    # -- the campaign ------------------------------------------------------------------------

    async def run(
        self,
        on_lead: Callable[[dict[str, bytes]], Awaitable[None] | None],
        on_follow: Callable[[str], None],
    ) -> None:
        """Campaign until cancelled.  ``on_lead(sets)``: this controller leads now, with
        every broker set's saved state (name -> value); ``on_follow(leader)``: it does
        not (or no longer) lead; ``leader``: the leader's address, "" if none is known."""
        was_leading = False
        try:
            while True:
                try:
                    await self._connect()
                    if await self._campaign():
                        sets = await self._load()
                        self._revision, self._valid_until = self._won  # leads from here
                        self.leader_address = self.address
                        log.warning(
                            "this controller (%s) leads now (etcd lease %d s); %d broker "
                            "set(s) in etcd",
                            self.address,
                            self._ttl,
                            len(sets),
                        )
                        was_leading = True
                        done = on_lead(sets)
                        if done is not None:
                            await done
                        await self._keep_alive()  # returns when the leadership is lost
                    else:
                        if was_leading:
                            was_leading = False
                        on_follow(self.leader_address)
                        await self._watch_leader()
                except EtcdUnavailable as exc:
                    self._step_down(str(exc))
                    on_follow("")
                    await anyio.sleep(min(0.5, self.ttl_s / 4))
                if was_leading and not self.leading:
                    was_leading = False
                    on_follow("")
        finally:
            await self._close()

    async def _connect(self) -> None:
        if self._client is not None:
            return
        import aetcd  # type: ignore[import-untyped]

        said = []
        for attempt in range(len(self.endpoints)):
            i = (self._which + attempt) % len(self.endpoints)
            host, _, port = self.endpoints[i].rpartition(":")
            client = aetcd.Client(host, int(port), timeout=REQUEST_TIMEOUT_S)
            try:
                await _bounded(client.status(), REQUEST_TIMEOUT_S * 2)
            except Exception as exc:
                said.append(f"{self.endpoints[i]}: {_one_line(exc)}")
                await _quietly_close(client)
                continue
            self._which, self._client = i, client
            return
        raise EtcdUnavailable("no etcd member answers (" + "; ".join(said) + ")")

    async def _reconnect(self, why: str) -> None:
        log.warning("etcd %s: %s; trying the next member", self.endpoints[self._which], why)
        await self._close()
        self._which = (self._which + 1) % len(self.endpoints)

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _quietly_close(client)

    async def _campaign(self) -> bool:
        """Create the leader key on a new lease if it is absent; whether we lead."""
        client = self._client
        tx = client.transactions
        sent_at = self._clock()

        async def campaign() -> tuple[bool, Any, Any]:
            lease = await client.lease(self.ttl_s)
            ok, answers = await client.transaction(
                compare=[tx.create(self.key) == 0],
                success=[tx.put(self.key, self.address.encode(), lease=lease.id)],
                failure=[tx.get(self.key)],
            )
            if not ok:
                await client.revoke_lease(lease.id)
                return False, lease, answers
            return True, lease, await client.get(self.key)

        try:
            won, lease, got = await _bounded(campaign(), REQUEST_TIMEOUT_S * 2)
        except Exception as exc:
            await self._reconnect(_one_line(exc))
            raise EtcdUnavailable(f"campaign failed: {_one_line(exc)}") from None
        if not won:
            [[(value, _)]] = got or [[(b"", None)]]
            self.leader_address = value.decode()
            return False
        if got is None or got.value != self.address.encode():
            return False  # (expired already)
        # not leading yet: the state is read first (see run)
        # etcd grants at least its own shortest lease (1.5 election timeouts, in whole
        # seconds: 2 s with its defaults) and says so: the key lives that long
        self._ttl = max(int(getattr(lease, "ttl", 0) or 0), self.ttl_s)
        self._lease, self._won = lease, (got.create_revision, sent_at + self._ttl)
        return True

    async def _load(self) -> dict[str, bytes]:
        client = self._client
        try:
            got = await _bounded(client.get_prefix(self.sets_prefix), REQUEST_TIMEOUT_S * 2)
        except Exception as exc:
            await self._reconnect(_one_line(exc))  # (the lease expires on its own)
            raise EtcdUnavailable(f"reading the state failed: {_one_line(exc)}") from None
        n = len(self.sets_prefix)
        return {kv.key[n:].decode(): kv.value for kv in got}

    async def _keep_alive(self) -> None:
        """Renew the lease every ttl/3 s until a renewal fails, the lease is gone or the
        leadership's time ran out."""
        client = self._client
        while self.leading:
            await anyio.sleep(self._ttl / 3)
            sent_at = self._clock()
            try:
                left = max(self._valid_until - sent_at, 0.05)
                reply = await _bounded(client.refresh_lease(self._lease.id), left)
            except Exception as exc:
                if self.leading:
                    await self._reconnect(_one_line(exc))
                    try:
                        await self._connect()
                        client = self._client
                    except EtcdUnavailable:
                        pass
                    continue
                break
            if reply is None or reply.TTL <= 0:
                self._step_down("its etcd lease expired")
                return
            # etcd counts the renewed TTL from when it got the request, after sent_at
            self._valid_until = max(self._valid_until, sent_at + min(reply.TTL, self._ttl))
        self._step_down("its etcd lease could not be renewed in time")

    async def _watch_leader(self) -> None:
        """Until the leader key is gone (then campaign)."""
        client = self._client
        while True:
            try:
                got = await _bounded(client.get(self.key), REQUEST_TIMEOUT_S * 2)
            except Exception as exc:
                await self._reconnect(_one_line(exc))
                raise EtcdUnavailable(f"watching the leader failed: {_one_line(exc)}") from None
            if got is None:
                return
            self.leader_address = got.value.decode()
            await anyio.sleep(WATCH_POLL_S)

    def _step_down(self, why: str) -> None:
        if self._revision:
            log.warning("this controller (%s) no longer leads: %s", self.address, why)
        self._revision = 0
        self._valid_until = 0.0
        if self.leader_address == self.address:
            self.leader_address = ""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _quietly_close(client: Any) -> None:
    try:
        await _bounded(client.close(), 1)
    except Exception:  # a client that cannot even close is dropped
        pass


async def _bounded(call: Coroutine[Any, Any, T], seconds: float) -> T:
    """``call``'s result, or TimeoutError after ``seconds`` even when it does not end on
    cancellation: a gRPC call to an etcd member that lost its leader was seen to ignore
    both its deadline and the cancellation (it is cancelled, and left to end on its own)."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except BaseException:
        task.cancel()
        task.add_done_callback(_forget)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_forget)
        raise TimeoutError(f"no answer from etcd within {seconds:g} s")
    return task.result()


def _forget(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # (retrieved: no "exception was never retrieved" warning)
