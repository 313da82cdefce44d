"""Who is calling the gRPC endpoint: RocketMQ 5's request signature, the server's side
(the clients' side, shared with txmq's gRPC transport, is in :mod:`txmq.security.signing`).

A RocketMQ 5 client with credentials sends, with every call (and when it opens its
Telemetry stream)::

    x-mq-date-time: 20250102T030405Z
    authorization: MQv2-HMAC-SHA1 Credential=<access key>, SignedHeaders=x-mq-date-time,
                   Signature=<hex HMAC-SHA1(secret key, the x-mq-date-time value)>

:func:`authenticate` checks it against the guard's users: the header is there and well
formed, the access key is known, the signature matches (compared in constant time), and the
date-time is within the guard's time window (``guard.authenticator.window_ms``) of this
server's clock.  A client without credentials still sends the header (the official Python
client signs with an empty access key): that is "not signed".

The date-time is read both as UTC and as this server's local time, and either reading may
be within the window: the scheme says UTC (the Java client and txmq's own send UTC), but
the official Python client formats its *local* time with a literal ``Z``
(``datetime.now().strftime("%Y%m%dT%H%M%SZ")``).  So a Python client must run in the
broker's time zone (or both in UTC), else its requests are refused as signed hours away.

Weaker than txmq's own protocol (:mod:`txmq.security.signing`, which signs every request's
content with a per-connection nonce and refuses replays): RocketMQ 5's gRPC scheme signs
only the time, not the request, so a captured header authenticates any request for as
long as its time is within the window.  TLS on the gRPC port is what keeps headers from
being captured; run the endpoint with TLS wherever access control matters.
"""

from __future__ import annotations

import calendar
import hmac
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from txmq.protocol.wire.errors import AuthenticationFailed
from txmq.security.acl.guard import Guard, Peer
from txmq.security.acl.policy import User
from txmq.security.signing import (
    ALGORITHM,
    AUTHORIZATION,
    DATE_TIME,
    DATE_TIME_FORMAT,
    grpc_signature,
)

__all__ = [
    "GrpcPeer",
    "authenticate",
    "grpc_peer",
    "verify",
]

#: the date-time has whole seconds: a header signed now is up to this much behind
_RESOLUTION_MS = 1000
_HINT = (
    "check the clocks (the official Python client signs its local time: run it in the "
    "broker's time zone), or it is a replay"
)


@dataclass(slots=True)
class GrpcPeer:
    """A gRPC caller as the guard sees it (:class:`txmq.security.acl.guard.Peer`)."""

    name: str
    attributes: dict[str, Any] = field(default_factory=dict)


def grpc_peer(peer: str) -> GrpcPeer:
    """The caller of ``context.peer()`` ("ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", the
    brackets perhaps %-encoded), named ``HOST:PORT`` ("127.0.0.1:5555", "[::1]:5555")."""
    text = unquote(peer)
    scheme, sep, rest = text.partition(":")
    if sep and scheme in ("ipv4", "ipv6", "unix", "unix-abstract"):
        text = rest
    return GrpcPeer(text)


# -- the server's side --------------------------------------------------------------------


def _header(metadata: Iterable[Any] | None, key: str) -> str | None:
    for entry in metadata or ():
        name, value = entry[0], entry[1]
        if name == key:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


def _fields(value: str, what: str) -> tuple[str, str]:
    """(access key, signature) of an ``authorization`` value, or AuthenticationFailed."""
    algorithm, _, rest = value.strip().partition(" ")
    if algorithm != ALGORITHM:
        raise AuthenticationFailed(
            f"{what}: unknown signature algorithm {algorithm[:40]!r} in the authorization "
            f"header (this server takes {ALGORITHM})"
        )
    parts: dict[str, str] = {}
    for item in rest.split(","):
        name, eq, val = item.strip().partition("=")
        if eq:
            parts[name.strip()] = val.strip()
    if "Credential" not in parts or "Signature" not in parts:
        raise AuthenticationFailed(
            f"{what}: the authorization header is malformed (it needs Credential=... and "
            "Signature=...)"
        )
    # Credential=<access key>[/...]: RocketMQ's proxy takes what comes before a "/"
    return parts["Credential"].split("/", 1)[0], parts["Signature"]


def _signed_at(date_time: str, what: str) -> tuple[float, float]:
    """The time ``date_time`` names in seconds since the epoch: (read as UTC, read as this
    server's local time)."""
    try:
        parsed = time.strptime(date_time, DATE_TIME_FORMAT)
    except ValueError:
        raise AuthenticationFailed(
            f"{what}: the {DATE_TIME} header {date_time[:40]!r} is not a date-time like "
            "20250102T030405Z"
        ) from None
    p = parsed  # as local time: whether daylight saving applies, mktime knows (-1)
    local = time.mktime(
        (p.tm_year, p.tm_mon, p.tm_mday, p.tm_hour, p.tm_min, p.tm_sec, p.tm_wday, p.tm_yday, -1)
    )
    return float(calendar.timegm(parsed)), local


def verify(
    metadata: Iterable[Any] | None,
    secret_of: Callable[[str], bytes | None],
    *,
    window_ms: int,
    what: str,
    clock: Callable[[], float] = time.time,
) -> str:
    """The access key that signed a call with ``metadata`` (``context.invocation_metadata()``),
    or AuthenticationFailed saying why not; ``secret_of(access_key)`` is the user's secret
    (None: no such user)."""
    value = _header(metadata, AUTHORIZATION)
    access_key, signature = _fields(value, what) if value else ("", "")
    if not access_key:
        raise AuthenticationFailed(
            f"{what} is not signed: this server requires credentials (RocketMQ 5 clients: "
            "ClientConfiguration(endpoints, Credentials(access_key, secret_key)); txmq's: "
            "access_key/secret_key, or TXMQ_ACCESS_KEY and TXMQ_SECRET_KEY)"
        )
    date_time = _header(metadata, DATE_TIME)
    if not date_time:
        raise AuthenticationFailed(f"{what}: signed, but the {DATE_TIME} header is missing")
    secret = secret_of(access_key)
    if secret is None:
        raise AuthenticationFailed(f"{what}: unknown access key {access_key!r}")
    expected = grpc_signature(secret, date_time).encode()
    if not hmac.compare_digest(expected, signature.lower().encode("utf-8", "replace")):
        raise AuthenticationFailed(
            f"{what}: the signature of {access_key!r} does not match (a wrong secret key)"
        )
    now_ms = clock() * 1000
    # how far the clock is past the signed second (negative: before it), either reading
    offsets = [now_ms - at * 1000 for at in _signed_at(date_time, what)]
    if any(-window_ms <= o <= window_ms + _RESOLUTION_MS for o in offsets):
        return access_key
    late = min(offsets, key=abs)
    raise AuthenticationFailed(
        f"{what}: signed at {date_time}, {abs(late) / 1000:.1f} s "
        f"{'before' if late > 0 else 'after'} this server's clock (read as UTC or as local "
        f"time; allowed: {window_ms / 1000:g} s): {_HINT}"
    )


def authenticate(guard: Guard, metadata: Iterable[Any] | None, peer: Peer, what: str) -> User:
    """The user who signed a gRPC call (its ``invocation_metadata()``), or
    AuthenticationFailed (counted in ``guard.refused`` and logged by the guard)."""
    authenticator = guard.authenticator

    def secret_of(access_key: str) -> bytes | None:
        user = guard.acl.users.get(access_key)
        return None if user is None else user.secret

    try:
        access_key = verify(
            metadata,
            secret_of,
            window_ms=authenticator.window_ms,
            what=what,
            clock=authenticator.clock,
        )
    except AuthenticationFailed as exc:
        guard.unauthenticated(peer, str(exc))
    user = guard.acl.users.get(access_key)
    if user is None:  # removed between the two lookups
        guard.unauthenticated(peer, f"{what}: unknown access key {access_key!r}")
    return user
