"""A server's access control: who is asking (:mod:`txmq.security.signing`) and whether they may
(:mod:`txmq.security.acl.policy`, :mod:`txmq.security.acl.rights`), with the ACL file read
again when it changes.  A :class:`txmq.protocol.rpc.Router` with a guard checks every request
before its handler runs; handlers that learn more (the half message of an END_TRANSACTION) call
:meth:`Guard.require` with the user the router put on the call.  How a connection is
authenticated (each request signed, or a TLS connection once): :mod:`.binding`."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, NoReturn, Protocol

import anyio

from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import PullMessage, SendBatchMessage, SendMessage
from txmq.protocol.wire.base import Request
from txmq.protocol.wire.errors import AuthenticationFailed, NoPermission
from txmq.protocol.wire.frame import NOTICE_SIGN_AGAIN, Frame
from txmq.security.acl.binding import AuthStrategy, Binding
from txmq.security.acl.policy import Acl, Resource, User
from txmq.security.acl.rights import needs
from txmq.security.signing import (
    DEFAULT_TIME_WINDOW_S,
    Authenticator,
    authenticated_notice,
    signer_of,
)
from txmq.security.tls import tls_peer

__all__ = ["Guard", "Peer", "peer_host"]

log = logging.getLogger("txmq.acl")

#: how often the ACL file is looked at for changes
WATCH_INTERVAL_S = 1.0
_CACHE_MAX = 100_000
#: refusals logged per minute at most (the rest are counted)
_LOG_PER_MINUTE = 30


class Peer(Protocol):
    """Who a request came from: a connection (:class:`txmq.protocol.connection.Connection`), or a
    gRPC caller; ``name`` is ``HOST:PORT``."""

    name: str
    attributes: dict[str, Any]


def peer_host(conn: Peer) -> str:
    """The client's address (no port) of a server's connection."""
    host = conn.attributes.get("peer_host")
    if host is None:
        host = conn.attributes["peer_host"] = conn.name.rpartition(":")[0].strip("[]")
    return str(host)


#: a connection's attribute: its :class:`Binding` (who signed its requests, whether it is
#: bound to them, and what they were allowed)
_STATE = "acl_binding"
#: sends' topics and pulls' queues a connection remembers it was allowed, at most
_KNOWN_MAX = 1024
_SIGN_AGAIN = bytes([NOTICE_SIGN_AGAIN])


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Guard:
    """The users and rules of an ACL file, and the checks a server runs on requests."""

    def __init__(
        self,
        path: Path,
        *,
        window_s: float = DEFAULT_TIME_WINDOW_S,
        who: str = "server",
        strategy: AuthStrategy = AuthStrategy.STATEFUL,
    ) -> None:
        self.path = Path(path)
        self.who = who
        self.strategy = strategy
        #: bumped at each change of the users or rules (connections check theirs again)
        self.generation = 0
        self._stamp = _stamp(self.path)
        self.acl = Acl.load(self.path)  # a bad file stops the server's start
        self.authenticator = Authenticator(self._secret, window_s=window_s)
        self._allowed: dict[tuple[str, Resource, str, str], bool] = {}
        self._log_window = 0.0
        self._logged = 0
        self._suppressed = 0
        #: refusals since start: authentication, permission
        self.refused = {"authentication": 0, "permission": 0}

    def _secret(self, access_key: str) -> bytes | None:
        user = self.acl.users.get(access_key)
        return None if user is None else user.secret

    # -- checks ---------------------------------------------------------------------------

    def authenticate(self, conn: Peer, frame: Frame, kind: type[Request[Any]]) -> User:
        """The user who signed ``frame`` (or whom its connection is bound to), or
        AuthenticationFailed."""
        attributes = conn.attributes
        state: Binding | None = attributes.get(_STATE)
        if state is None:
            state = attributes[_STATE] = self._binding(conn)
        if state.generation != self.generation:
            state.recheck(self.acl.users, self.generation)
            self._note_user(state, attributes)
        if state.bound:
            assert state.user is not None
            if not frame.auth:
                return state.user
            return self._signed_on_bound(conn, state, frame, kind)
        try:
            session = self.authenticator.check(frame, kind.__name__, state.session)
        except AuthenticationFailed as exc:
            refusal = exc
            if state.stateful and not frame.auth:
                frame.notice = _SIGN_AGAIN  # (a stateful client signs again)
                if state.dropped is not None:
                    refusal = AuthenticationFailed(
                        f"{kind.__name__} (code {frame.code}) is not signed and this connection "
                        f"is no longer authenticated ({state.dropped}): sign it again"
                    )
            self._refused("authentication", conn, str(refusal))
            raise refusal from None
        if state.session is session and state.user is not None:
            return state.user
        user = self.acl.users.get(session.access_key)
        if user is None:  # removed between the two lookups
            raise AuthenticationFailed(
                f"{kind.__name__}: unknown access key {session.access_key!r}"
            )
        state.session = session
        if state.stateful:
            state.bind(user, ident=session.ident)
            frame.notice = authenticated_notice(frame.auth)
        elif state.user is not user:
            state.user = user
            state.allowed.clear()
        attributes["acl_user"] = user.name
        return user

    def _binding(self, conn: Peer) -> Binding:
        """A new connection's state: over TLS under the stateful strategy, bound at once
        to the user its client certificate names."""
        peer = tls_peer(getattr(conn, "stream", None))
        stateful = peer is not None and self.strategy is AuthStrategy.STATEFUL
        state = Binding(
            stateful=stateful,
            cert_name=peer.common_name if peer is not None and stateful else None,
            generation=self.generation,
        )
        if state.cert_name is not None:
            user = self.acl.users.get(state.cert_name)
            if user is not None:
                state.bind(user, by_certificate=True)
                conn.attributes["acl_user"] = user.name
        return state

    def _note_user(self, state: Binding, attributes: dict[str, Any]) -> None:
        """``acl_user`` (whose producers a connection serves) after a recheck."""
        if state.user is not None:
            attributes["acl_user"] = state.user.name
        elif state.dropped is not None:
            attributes.pop("acl_user", None)

    def _signed_on_bound(
        self, conn: Peer, state: Binding, frame: Frame, kind: type[Request[Any]]
    ) -> User:
        """A signed request on a bound connection (an old client's, or one that has not
        heard yet): its bound user's, who need not be checked again; another user's is
        refused."""
        user = state.user
        assert user is not None
        auth = frame.auth
        who = signer_of(auth)
        if who is not None and who[0] == state.ident:
            frame.notice = authenticated_notice(auth)
            return user
        if who is not None and who[1] != user.name:
            message = (
                f"{kind.__name__} (code {frame.code}): signed by {who[1]!r}, but this TLS "
                f"connection is authenticated as {user.name!r} (by {state.how()}): use a "
                "connection of its own for each user"
            )
            self._refused("authentication", conn, message)
            raise AuthenticationFailed(message)
        try:  # the bound user's new signer (or its first on a certificate's connection)
            session = self.authenticator.check(frame, kind.__name__)
        except AuthenticationFailed as exc:
            self._refused("authentication", conn, str(exc))
            raise
        state.session = session
        state.ident = session.ident
        frame.notice = authenticated_notice(auth)
        return user

    def authorize(
        self, user: User, request: Request[Any], conn: Peer, what: str | None = None
    ) -> None:
        """NoPermission naming what ``user`` may not do, unless ``request`` is allowed
        (``what``: how the error names the request; default its class's name)."""
        if user.super_user:
            return
        # a connection's sends and pulls: what it was allowed before (forgotten when its
        # user or the rules change)
        kind = type(request)
        known: Binding | None = None
        key: Any = None
        if kind is SendMessage or kind is SendBatchMessage:
            known = conn.attributes.get(_STATE)
            key = request.topic  # type: ignore[attr-defined]
        elif kind is PullMessage:
            known = conn.attributes.get(_STATE)
            key = (request.group, request.topic)  # type: ignore[attr-defined]
        if known is not None:
            if known.user is not user:
                known = None
            elif key in known.allowed:
                return
        source = peer_host(conn)
        for need in needs(request):
            for res, action in need:
                if self.allowed(user, res, action, source):
                    break
            else:
                res, action = need[0]
                self.deny(user, action, res, what or kind.__name__, conn)
        if known is not None:
            if len(known.allowed) >= _KNOWN_MAX:
                known.allowed.clear()
            known.allowed.add(key)

    def require(self, user: User | None, action: str, res: Resource, what: str, conn: Peer) -> None:
        """NoPermission unless ``user`` may do ``action`` on ``res`` (None: no ACL)."""
        if user is None or user.super_user:
            return
        if not self.allowed(user, res, action, peer_host(conn)):
            self.deny(user, action, res, what, conn)

    def deny(self, user: User, action: str, res: Resource, what: str, conn: Peer) -> None:
        self.refuse(
            conn,
            f"{what}: user {user.name!r} has no {action!r} right on {res} (from {peer_host(conn)})",
        )

    def refuse(self, conn: Peer, message: str) -> None:
        """Raise NoPermission with ``message`` (logged and counted)."""
        self._refused("permission", conn, message)
        raise NoPermission(message)

    def unauthenticated(self, conn: Peer, message: str) -> NoReturn:
        """Raise AuthenticationFailed with ``message`` (logged and counted): for checks
        made outside :meth:`authenticate` (the gRPC endpoint's RocketMQ 5 signatures)."""
        self._refused("authentication", conn, message)
        raise AuthenticationFailed(message)

    def allowed(self, user: User, res: Resource, action: str, source: str) -> bool:
        key = (user.name, res, action, source)
        hit = self._allowed.get(key)
        if hit is None:
            if len(self._allowed) >= _CACHE_MAX:
                self._allowed.clear()
            hit = self._allowed[key] = user.may(action, res, source)
        return hit

    def _refused(self, why: str, conn: Peer, message: str) -> None:
        self.refused[why] += 1
        now = time.monotonic()
        if now - self._log_window >= 60:
            if self._suppressed:
                log.warning("%s: %d more refusals not logged", self.who, self._suppressed)
            self._log_window, self._logged, self._suppressed = now, 0, 0
        if self._logged < _LOG_PER_MINUTE:
            self._logged += 1
            log.warning("%s refused a request from %s: %s", self.who, conn.name, message)
        else:
            self._suppressed += 1

    # -- the file -------------------------------------------------------------------------

    def reload(self) -> bool:
        """Read the file again if it changed; a bad file is logged and the rules in force
        stay.  Whether new rules took effect."""
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            acl = Acl.load(self.path)
        except SettingsError as exc:
            log.error("%s keeps its access rules: %s", self.who, exc)
            return False
        self._use(acl)
        log.info(
            "%s: access rules read again from %s (%d users)", self.who, self.path, len(acl.users)
        )
        return True

    def replace(self, acl: Acl) -> None:
        """Use ``acl`` and write it to the file (an admin command's change)."""
        acl.save(self.path)
        self._stamp = _stamp(self.path)
        self._use(acl)

    def _use(self, acl: Acl) -> None:
        self.acl = acl
        self._allowed = {}
        self.generation += 1  # (each connection's user and rights are looked up again)
        self.authenticator.forget()

    async def watch(self, interval: float = WATCH_INTERVAL_S) -> None:
        """Read the file again whenever it changes (run it in the server's task group)."""
        while True:
            await anyio.sleep(interval)
            self.reload()
