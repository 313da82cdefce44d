"""What the console process holds: its settings, one operator client (started at first
use, so that a broker that is down when the console starts is a 503 page, not a failed
start), the history behind the charts (sampled in the background every few seconds and
kept in memory only), and the operator actions the client lacks as methods.

The console asks brokers through :class:`txmq.admin.client.AdminClient` (one broker, or every
broker of a cluster through name servers); it never imports the broker's code.

The shared client signs with the console process's own credentials ($TXMQ_ACCESS_KEY and
$TXMQ_SECRET_KEY, or the ``[client]`` table of $TXMQ_CONFIG), if it has any.  Without
``login`` it serves every browser; with it, each logged-in browser has a client of its own
(:mod:`txmq.console.sessions`) and the shared one serves the background sampler alone (a
refusal shows as the charts' last error).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio

from txmq.admin.client import AdminClient, BrokerRow
from txmq.protocol.wire import GetConsumerListByGroup, GroupOffset
from txmq.protocol.wire.errors import TxmqError

__all__ = [
    "LOOPBACK",
    "ConsoleConfig",
    "ConsoleState",
    "History",
    "OperatorClient",
    "Point",
]

log = logging.getLogger("txmq.console")

#: (epoch seconds, value)
Point = tuple[float, float]
K = TypeVar("K")
#: the names of this machine a browser uses for a console on loopback
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass
class ConsoleConfig:
    """How ``txmq console`` was started."""

    #: one broker's address, or name servers ("h1:p1;h2:p2"); neither: $TXMQ_* or the default
    broker: str | None = None
    namesrv: str | None = None
    #: producer databases (SQLAlchemy URLs) whose transaction logs the console reads
    dbs: list[str] = field(default_factory=list)
    #: the --out folder of ``txmq reconcile``: its (newest) summary.json is the
    #: reconciliation page
    reports: str | None = None
    #: how often the background sampler asks for rates and lag (seconds)
    sample_every_s: float = 5.0
    #: how often a page refreshes its live part (seconds)
    refresh_s: float = 3.0
    #: samples kept per chart line
    history: int = 120
    #: bytes of a message body shown in a page; the rest is a download
    body_limit: int = 64 * 1024
    #: seconds a broker request may take
    request_timeout: float = 3.0
    #: the Host headers the console answers ("*": any); the loopback names by default, so
    #: that a page of another site cannot reach it through DNS rebinding
    allowed_hosts: list[str] = field(default_factory=lambda: list(LOOPBACK))
    #: every page wants a logged-in user of the brokers' ACL, whose own client signs that
    #: browser's requests (:mod:`txmq.console.login`); off: one shared client, signing
    #: with $TXMQ_ACCESS_KEY / $TXMQ_SECRET_KEY if set, serves every browser
    login: bool = False
    #: a session ends after this long without a page or an action (seconds)...
    session_idle_s: float = 30 * 60
    #: ...and this long after its login, whatever its use
    session_max_s: float = 12 * 3600
    #: sessions kept at most (a new login ends the least recently used one)
    max_sessions: int = 1000


class OperatorClient(AdminClient):
    """An :class:`AdminClient` with the operator actions the console needs and the admin
    client has no method for yet, made of the existing wire requests."""

    async def members(self, group: str) -> dict[str, list[str]]:
        """The client ids of consumer group ``group``'s members, by broker set ("" for a
        broker asked directly)."""
        answers = await self._each(
            await self.brokers(), lambda t: self.ask(t, GetConsumerListByGroup(group=group))
        )
        return {t.broker_name: sorted(answer.client_ids) for t, answer in answers}


class History:
    """The console's memory of rates and lag: a bounded series per line."""

    def __init__(self, size: int) -> None:
        self.size = size
        #: broker ("<set>/<id>" or its address) -> put / get messages per second
        self.put: dict[str, deque[Point]] = {}
        self.get: dict[str, deque[Point]] = {}
        #: consumer group -> its total lag
        self.group_lag: dict[str, deque[Point]] = {}
        #: (group, topic, broker set, queue id) -> that queue's lag
        self.queue_lag: dict[tuple[str, str, str, int], deque[Point]] = {}
        self.last_sample = 0.0
        self.last_error = ""

    def _add(self, table: dict[K, deque[Point]], key: K, now: float, value: float) -> None:
        line = table.get(key)
        if line is None:
            line = table[key] = deque(maxlen=self.size)
        line.append((now, value))

    def record_cluster(self, rows: Sequence[BrokerRow], now: float) -> None:
        for row in rows:
            if row.error:
                continue
            key = broker_key(row)
            self._add(self.put, key, now, row.put_tps)
            self._add(self.get, key, now, row.get_tps)

    def record_offsets(self, offsets: Sequence[GroupOffset], now: float) -> None:
        totals: dict[str, int] = {}
        for o in offsets:
            totals[o.group] = totals.get(o.group, 0) + o.lag
            self._add(self.queue_lag, (o.group, o.topic, o.broker_name, o.queue_id), now, o.lag)
        for group, total in totals.items():
            self._add(self.group_lag, group, now, total)


def broker_key(row: BrokerRow) -> str:
    return f"{row.broker_name}/{row.broker_id}" if row.broker_name else row.address


class ConsoleState:
    """The console process's state (one per app)."""

    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.history = History(config.history)
        #: the per-process CSRF secret (tokens do not outlive the process)
        self.secret = secrets.token_bytes(32)
        self._client: OperatorClient | None = None
        self._lock = anyio.Lock()
        #: results of actions, shown once on the page they redirect to
        self.flashes: OrderedDict[str, tuple[str, str]] = OrderedDict()

    @property
    def where(self) -> str:
        """What the console asks, for error pages: the broker or the name servers."""
        if self.config.namesrv:
            return f"name servers {self.config.namesrv}"
        return f"broker {self.config.broker or '(default address)'}"

    async def client(self) -> OperatorClient:
        """The shared operator client, signing with the console process's credentials
        (started now if it is not: raises if the broker or the name servers cannot be
        reached).  Pages and actions get theirs from :func:`txmq.console.web.client_of`."""
        async with self._lock:
            if self._client is None:
                client = OperatorClient(
                    self.config.broker,
                    namesrv=self.config.namesrv,
                    request_timeout=self.config.request_timeout,
                    connect_timeout=self.config.request_timeout,
                )
                await client.start()
                self._client = client
            return self._client

    async def close(self) -> None:
        async with self._lock:
            client, self._client = self._client, None
        if client is not None:
            await client.stop()

    def flash(self, kind: str, text: str) -> str:
        """Keep a result to show once; its id goes in the redirect."""
        key = secrets.token_urlsafe(8)
        self.flashes[key] = (kind, text)
        while len(self.flashes) > 200:
            self.flashes.popitem(last=False)
        return key

    async def sample(self) -> None:
        """One sample of every broker's rates and every group's lag."""
        client = await self.client()
        now = time.time()
        rows = await client.cluster()
        offsets = await client.offsets()
        self.history.record_cluster(rows, now)
        self.history.record_offsets(offsets, now)
        self.history.last_sample = now
        self.history.last_error = ""

    async def sample_forever(self) -> None:
        while True:
            try:
                await self.sample()
            except (TxmqError, OSError, ValueError) as exc:
                if str(exc) != self.history.last_error:
                    log.warning("sampling %s failed: %s", self.where, exc)
                self.history.last_error = str(exc)
            await anyio.sleep(self.config.sample_every_s)
