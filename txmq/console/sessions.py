"""The console's logins (``txmq console --login``): sessions, and the limit on failed logins.

A session is what a browser that logged in holds: a random id (its cookie
``txmq_session``) mapped, in this process's memory only, to the user's name and an
:class:`~txmq.console.state.OperatorClient` signing as that user, so that the brokers check
each request of that browser under that user's rules.  It ends at logout, after
``session_idle_s`` without a page or an action (a page's live refresh is no use: a tab
left open expires), ``session_max_s`` after its login whatever its use, when the brokers
no longer know the user, or when ``max_sessions`` are kept and a login needs room (the
least recently used one goes).  Its client is stopped then.  Sessions die with the
process: a restarted console asks every browser to log in again.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from txmq.console.state import ConsoleConfig, OperatorClient

__all__ = ["COOKIE", "SCOPE_KEY", "LoginLimiter", "Session", "Sessions"]

log = logging.getLogger("txmq.console")

#: the cookie holding a browser's session id
COOKIE = "txmq_session"
#: where the login check puts a request's :class:`Session` in its ASGI scope
SCOPE_KEY = "txmq.session"

Clock = Callable[[], float]


@dataclass(eq=False)
class Session:
    """A logged-in browser: who it is and the client that signs as that user."""

    id: str
    user: str
    client: OperatorClient
    #: when it logged in, and when it last asked for a page or an action (clock seconds)
    created: float
    used: float
    super_user: bool = False


class Sessions:
    """Every session of this process, least recently used first."""

    def __init__(self, config: ConsoleConfig, *, clock: Clock = time.monotonic) -> None:
        self.idle_s = config.session_idle_s
        self.max_s = config.session_max_s
        self.limit = max(1, config.max_sessions)
        self.clock = clock
        self.limiter = LoginLimiter(clock=clock)
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def _expired(self, session: Session, now: float) -> bool:
        return now - session.used > self.idle_s or now - session.created > self.max_s

    async def get(self, session_id: str, *, touch: bool = True) -> Session | None:
        """The live session ``session_id`` (None: unknown, or it has just expired and is
        ended); ``touch``: this is a use (it keeps the session from its idle expiry)."""
        session = self._by_id.get(session_id) if session_id else None
        if session is None:
            return None
        now = self.clock()
        if self._expired(session, now):
            await self.end(session_id)
            return None
        if touch:
            session.used = now
            self._by_id.move_to_end(session_id)
        return session

    async def add(self, user: str, client: OperatorClient, *, super_user: bool = False) -> Session:
        """A new session of ``user`` with its started ``client`` (ending expired sessions,
        and the least recently used ones while there are too many)."""
        await self.sweep()
        while len(self._by_id) >= self.limit:
            oldest = next(iter(self._by_id))
            log.info("console: session of %s ended: too many sessions", self._by_id[oldest].user)
            await self.end(oldest)
        now = self.clock()
        session = Session(secrets.token_urlsafe(32), user, client, now, now, super_user)
        self._by_id[session.id] = session
        return session

    async def end(self, session_id: str) -> Session | None:
        """End session ``session_id`` and stop its client (None: there was none)."""
        session = self._by_id.pop(session_id, None)
        if session is not None:
            await _stop(session.client)
        return session

    async def sweep(self) -> int:
        """End every expired session; how many."""
        now = self.clock()
        expired = [sid for sid, s in self._by_id.items() if self._expired(s, now)]
        for sid in expired:
            await self.end(sid)
        return len(expired)

    async def sweep_forever(self, every_s: float = 60.0) -> None:
        while True:
            await anyio.sleep(every_s)
            await self.sweep()

    async def close(self) -> None:
        """End every session (the console stops)."""
        for sid in list(self._by_id):
            await self.end(sid)


async def _stop(client: OperatorClient) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await client.stop()
        except Exception as exc:  # a session's end must not fail the request that ends it
            log.warning("stopping a session's client failed: %s", exc)


class LoginLimiter:
    """At most ``failures`` failed logins per client address within ``window_s`` seconds:
    after that, that address may not try again until the first of them is ``window_s``
    old."""

    def __init__(
        self,
        failures: int = 5,
        window_s: float = 60.0,
        *,
        clock: Clock = time.monotonic,
        max_addresses: int = 10_000,
    ) -> None:
        self.failures = failures
        self.window_s = window_s
        self.clock = clock
        self.max_addresses = max_addresses
        self._failed: dict[str, deque[float]] = {}

    def wait_s(self, address: str) -> float:
        """Seconds until ``address`` may try to log in again (0: now)."""
        times = self._failed.get(address)
        if times is None or len(times) < self.failures:
            return 0.0
        return max(0.0, times[0] + self.window_s - self.clock())

    def failed(self, address: str) -> None:
        now = self.clock()
        times = self._failed.get(address)
        if times is None:
            if len(self._failed) >= self.max_addresses:
                self._forget(now)
            times = self._failed[address] = deque(maxlen=self.failures)
        times.append(now)

    def succeeded(self, address: str) -> None:
        self._failed.pop(address, None)

    def _forget(self, now: float) -> None:
        """Room for a new address: those whose failures are all old go; if none is, the
        one that failed first."""
        old = [a for a, t in self._failed.items() if now - t[-1] > self.window_s]
        for address in old or [next(iter(self._failed))]:
            del self._failed[address]
