"""Signed requests: who sent a request, and that it is fresh and unaltered.

A client with credentials signs every request it sends.  The frame gets an auth trailer
(:mod:`txmq.protocol.wire.frame`)::

    offset  size  field
    0       1     scheme (1: HMAC-SHA256)
    1       8     the client's clock when it signed, in ms since the epoch (signed, LE)
    9       8     the connection's nonce prefix (random per connection)
    17      8     the request's number on that connection (LE, from 1)
    25      A     the access key (UTF-8)
    25+A    32    HMAC-SHA256(secret key, the prefix's version, kind, code and header
                  length, bytes 0..25+A of the trailer, the header, the body)

The server (:class:`Authenticator`) refuses a request that is unsigned, of an unknown
access key, with a signature that does not match, signed further than the time window from
its clock, or whose (access key, prefix, number) it has seen before: a replay.  It keeps,
per prefix, the highest number seen and which of the 256 before it came, for as long as
a replay would still be in the time window.

Over TLS a server with the stateful strategy (:mod:`txmq.security.acl.binding`) holds the
connection authenticated after its first signed request and says so on the answer
(:data:`~txmq.protocol.wire.frame.NOTICE_AUTHENTICATED`, naming that request's number): a
:class:`Signer` made ``stateful`` then sends the connection's requests unsigned (oneway
requests, which get no answer to say "sign again", stay signed) until an answer says
:data:`~txmq.protocol.wire.frame.NOTICE_SIGN_AGAIN`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections.abc import Callable
from datetime import UTC, datetime
from hashlib import sha1

from txmq.protocol.wire.errors import AuthenticationFailed
from txmq.protocol.wire.frame import (
    NOTICE_AUTHENTICATED,
    NOTICE_SIGN_AGAIN,
    SIGNED,
    SIGNED_FIELDS,
    Frame,
    FrameKind,
    encode_frame,
    encode_signed_frame,
)
from txmq.security.credentials import Credentials

__all__ = [
    "ALGORITHM",
    "AUTHORIZATION",
    "DATE_TIME",
    "DATE_TIME_FORMAT",
    "DEFAULT_TIME_WINDOW_S",
    "Authenticator",
    "Mac",
    "Signer",
    "authenticated_notice",
    "authorization",
    "grpc_signature",
    "signed_metadata",
    "signer_of",
]

SCHEME = 1
_META = struct.Struct("<Bq8sQ")
#: the time and the number, in the trailer after its scheme byte
_TIME_NUMBER = struct.Struct("<q8xQ")
#: where the trailer's prefix, number and access key start
_PREFIX_AT, _NUMBER_AT, _KEY_AT = 9, 17, _META.size
_NUMBER = struct.Struct("<Q")
_SIG = 32
#: how far a request's time may be from the server's clock (either way)
DEFAULT_TIME_WINDOW_S = 60.0
#: how many numbers behind the highest a request may come (reordered) and still be taken
_REPLAY_SPAN = 256
_SPAN_MASK = (1 << _REPLAY_SPAN) - 1


class Mac:
    """HMAC-SHA256 with one key, its padded-key hash states made once (``hmac.digest``
    makes them again for every message: most of its cost for a small one)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, secret: bytes) -> None:
        key = hashlib.sha256(secret).digest() if len(secret) > 64 else secret
        key = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(key.translate(_IPAD))
        self._outer = hashlib.sha256(key.translate(_OPAD))

    def __call__(self, head: bytes, header: bytes, body: bytes | memoryview) -> bytes:
        """The MAC of ``head``, ``header`` and ``body`` one after another (three parts, not
        any number: it runs for every request, on both sides)."""
        inner = self._inner.copy()
        inner.update(head)
        inner.update(header)
        inner.update(body)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


_IPAD = bytes(b ^ 0x36 for b in range(256))
_OPAD = bytes(b ^ 0x5C for b in range(256))


class Signer:
    """Signs the requests of one connection (each connection has its own prefix).
    ``stateful`` (a TLS connection's): stops signing when the server's answer says the
    connection is authenticated, resumes when one says sign again."""

    __slots__ = ("_ak", "_count", "_mac", "_prefix", "_resumed", "clock", "signing", "stateful")

    def __init__(
        self,
        credentials: Credentials,
        clock: Callable[[], float] = time.time,
        *,
        stateful: bool = False,
    ) -> None:
        self._ak = credentials.access_key.encode()
        self._mac = Mac(credentials.secret)
        self._prefix = os.urandom(8)
        self._count = 0
        self.clock = clock
        self.stateful = stateful
        #: whether requests are signed now (False: the server holds the connection
        #: authenticated)
        self.signing = True
        #: the first number signed since signing resumed: an older request's answer saying
        #: "authenticated" came before the server dropped the connection's authentication
        self._resumed = 0

    @property
    def signed(self) -> int:
        """How many requests it signed."""
        return self._count

    def notice(self, notice: bytes) -> None:
        """An answer's notice about the connection's authentication."""
        if not notice:
            return
        if notice[0] == NOTICE_AUTHENTICATED and len(notice) == _NOTICE.size:
            if self.stateful and self.signing:
                (_, number) = _NOTICE.unpack(notice)
                if number >= self._resumed:
                    self.signing = False
        elif notice[0] == NOTICE_SIGN_AGAIN and not self.signing:
            self.signing = True
            self._resumed = self._count + 1

    def trailer(self, fields: bytes, header: bytes, body: bytes | memoryview) -> bytes:
        self._count += 1
        meta = _META.pack(SCHEME, int(self.clock() * 1000), self._prefix, self._count) + self._ak
        return meta + self._mac(fields + meta, header, body)

    def frame(
        self,
        kind: FrameKind,
        code: int,
        request_id: int,
        header: bytes,
        body: bytes | memoryview,
        version: int,
    ) -> bytes:
        """A signed request frame (unsigned while the server holds the connection
        authenticated, but for a oneway request)."""
        if self.signing or kind == FrameKind.ONEWAY:
            return encode_signed_frame(kind, code, request_id, header, body, version, self.trailer)
        return encode_frame(kind, code, request_id, header, body, version)


#: the "authenticated" notice: its byte, and the number of the signed request answered
_NOTICE = struct.Struct("<BQ")


def authenticated_notice(auth: bytes) -> bytes:
    """The notice answering the request signed with trailer ``auth``: the connection is
    authenticated."""
    return _NOTICE.pack(NOTICE_AUTHENTICATED, _NUMBER.unpack_from(auth, _NUMBER_AT)[0])


def signer_of(auth: bytes) -> tuple[bytes, str] | None:
    """Who signed with trailer ``auth``: the prefix and access key bytes it names (a
    session's ``ident``) and the access key; None for a trailer too short or not UTF-8."""
    if len(auth) < _META.size + 1 + _SIG:
        return None
    try:
        access_key = auth[_KEY_AT:-_SIG].decode()
    except UnicodeDecodeError:
        return None
    return auth[_PREFIX_AT:_NUMBER_AT] + auth[_KEY_AT:-_SIG], access_key


def _failed(kind: str, frame: Frame, why: str, sep: str = ": ") -> AuthenticationFailed:
    return AuthenticationFailed(f"{kind} (code {frame.code}){sep}{why}")


class _Seen:
    __slots__ = ("bits", "high", "last")

    def __init__(self) -> None:
        self.high = 0
        self.bits = 0  # bit i: number high - i was seen
        self.last = 0.0


def _fresh(seen: _Seen, number: int, now: float) -> bool:
    """Whether ``number`` was not seen before (now it was)."""
    seen.last = now
    if number > seen.high:
        shift = number - seen.high
        seen.bits = ((seen.bits << shift) | 1) & _SPAN_MASK if shift < _REPLAY_SPAN else 1
        seen.high = number
        return True
    back = seen.high - number
    if back >= _REPLAY_SPAN or number <= 0 or seen.bits >> back & 1:
        return False
    seen.bits |= 1 << back
    return True


class Session:
    """What one connection's requests are signed with (its prefix and access key), checked
    in full on its first request: later ones that name the same need only their signature,
    time and number checked (:meth:`Authenticator.check` with ``known``)."""

    __slots__ = ("access_key", "epoch", "ident", "mac", "seen")

    def __init__(self, access_key: str, ident: bytes, mac: Mac, seen: _Seen, epoch: int) -> None:
        self.access_key = access_key
        #: the trailer's prefix and access key bytes
        self.ident = ident
        self.mac = mac
        self.seen = seen
        self.epoch = epoch


class Authenticator:
    """Checks signed requests: ``secret_of(access_key)`` is the user's secret (None: no
    such user).  Used from one thread: the server's event loop."""

    def __init__(
        self,
        secret_of: Callable[[str], bytes | None],
        *,
        window_s: float = DEFAULT_TIME_WINDOW_S,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.secret_of = secret_of
        self.window_ms = int(window_s * 1000)
        self.clock = clock
        self.monotonic = monotonic
        self._seen: dict[bytes, _Seen] = {}
        #: each secret key's MAC (by the secret: a changed key gets its own)
        self._macs: dict[bytes, Mac] = {}
        self._next_sweep = 0.0
        #: sessions made before the latest change (of users, or of the numbers remembered)
        #: are checked in full again
        self.epoch = 0

    def forget(self) -> None:
        """The users changed: check every connection's next request in full."""
        self.epoch += 1

    def check(self, frame: Frame, kind: str, known: Session | None = None) -> Session:
        """The session (access key) that signed ``frame`` (a request of class ``kind``, as
        errors name it), or :class:`AuthenticationFailed` saying why not.  ``known``: the
        session of the connection's previous request."""
        now = self.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)  # (first: a session's numbers may be forgotten)
        auth = frame.auth
        if (
            known is not None
            and known.epoch == self.epoch
            and auth[_PREFIX_AT:_NUMBER_AT] + auth[_KEY_AT:-_SIG] == known.ident
            and auth[0] == SCHEME
        ):
            session = known
        else:
            session = self._session(frame, kind)
        ts, number = _TIME_NUMBER.unpack_from(auth, 1)
        fields = SIGNED_FIELDS.pack(
            frame.version, frame.kind | SIGNED, frame.code, len(frame.header)
        )
        if not hmac.compare_digest(
            session.mac(fields + auth[:-_SIG], frame.header, frame.body), auth[-_SIG:]
        ):
            raise _failed(
                kind,
                frame,
                f"the signature of {session.access_key!r} does not match (a wrong secret key, "
                "or the request was altered)",
            )
        now_ms = int(self.clock() * 1000)
        if abs(now_ms - ts) > self.window_ms:
            raise _failed(
                kind,
                frame,
                f"signed at {ts} ms, {abs(now_ms - ts) / 1000:.1f} s "
                f"{'before' if ts < now_ms else 'after'} this server's clock (allowed: "
                f"{self.window_ms / 1000:g} s): check the clocks, or it is a replay",
            )
        if not _fresh(session.seen, number, now):
            raise _failed(kind, frame, "replayed (this request was seen before)")
        return session

    def _session(self, frame: Frame, kind: str) -> Session:
        """Who signed ``frame``, looked up in full (its signature is checked after)."""
        auth = frame.auth
        if len(auth) < _META.size + 1 + _SIG:
            if not auth:
                raise _failed(
                    kind,
                    frame,
                    "is not signed: this server requires credentials (set TXMQ_ACCESS_KEY "
                    "and TXMQ_SECRET_KEY, or pass access_key/secret_key to the client)",
                    sep=" ",
                )
            raise _failed(kind, frame, "the signature trailer is too short")
        scheme, _, prefix, _ = _META.unpack_from(auth)
        if scheme != SCHEME:
            raise _failed(kind, frame, f"unknown signature scheme {scheme}")
        try:
            access_key = auth[_KEY_AT:-_SIG].decode()
        except UnicodeDecodeError:
            raise _failed(kind, frame, "the access key is not UTF-8") from None
        secret = self.secret_of(access_key)
        if secret is None:
            raise _failed(kind, frame, f"unknown access key {access_key!r}")
        mac = self._macs.get(secret)
        if mac is None:
            if len(self._macs) >= 4096:  # keys changed many times: start afresh
                self._macs.clear()
            mac = self._macs[secret] = Mac(secret)
        ident = prefix + auth[_KEY_AT:-_SIG]
        seen = self._seen.get(ident)
        if seen is None:
            seen = self._seen[ident] = _Seen()
        return Session(access_key, ident, mac, seen, self.epoch)

    def _sweep(self, now: float) -> None:
        """Forget prefixes unused for longer than a replay of them could still be on time."""
        horizon = now - 2 * self.window_ms / 1000 - 1
        gone = [k for k, s in self._seen.items() if s.last < horizon]
        for key in gone:
            del self._seen[key]
        if gone:  # (a session holding one must look it up again)
            self.epoch += 1
        self._next_sweep = now + max(1.0, self.window_ms / 1000)

    @property
    def tracked(self) -> int:
        """How many connections' numbers it remembers."""
        return len(self._seen)


# -- RocketMQ 5's gRPC signature (the clients' side; the server checks it in
# txmq.security.acl.grpc_auth) --------------------------------------------------------------------

#: the metadata keys and the one algorithm RocketMQ 5 clients use
AUTHORIZATION = "authorization"
DATE_TIME = "x-mq-date-time"
ALGORITHM = "MQv2-HMAC-SHA1"
DATE_TIME_FORMAT = "%Y%m%dT%H%M%SZ"


def grpc_signature(secret: bytes, date_time: str) -> str:
    """The hex HMAC-SHA1 of ``date_time`` with ``secret`` (RocketMQ 5's signature)."""
    return hmac.new(secret, date_time.encode(), sha1).hexdigest()


def authorization(credentials: Credentials, date_time: str) -> str:
    """The ``authorization`` value signing ``date_time`` (the ``x-mq-date-time`` value)."""
    signature = grpc_signature(credentials.secret, date_time)
    return (
        f"{ALGORITHM} Credential={credentials.access_key}, SignedHeaders={DATE_TIME}, "
        f"Signature={signature}"
    )


def signed_metadata(
    credentials: Credentials, now: datetime | None = None
) -> tuple[tuple[str, str], tuple[str, str]]:
    """The two metadata entries signing a call made ``now`` (default: this moment, UTC)."""
    date_time = (now or datetime.now(UTC)).strftime(DATE_TIME_FORMAT)
    return ((DATE_TIME, date_time), (AUTHORIZATION, authorization(credentials, date_time)))
