"""How a server authenticates a connection's requests: RocketMQ 5.3's two strategies.

``stateless`` (RocketMQ's default): every request is signed and its signature checked
(:mod:`txmq.security.signing`).

``stateful`` (txmq's default): on a TLS connection the first signed request authenticates
the connection: the server *binds* it to that user and says so on the answer
(:data:`~txmq.protocol.wire.frame.NOTICE_AUTHENTICATED`); the client's later requests on it
go unsigned (TLS already keeps anyone else from writing on the connection, and keeps what is
written from being altered or replayed).  A request signed by another user on a bound
connection is refused.  With ``tls_ca`` (mutual TLS) a client certificate whose subject
common name (CN) is a user's name binds the connection to that user from the start; a
certificate naming no user leaves the connection to be bound by a signature.  Plaintext
connections are never bound: each of their requests is signed, whatever the strategy.

When the users or rules change (the ACL file read again, or an admin command), a bound
connection's user is looked up again before its next request: removed, or its secret key
changed (a signature's binding) — the binding is dropped, the next unsigned request is
refused with :data:`~txmq.protocol.wire.frame.NOTICE_SIGN_AGAIN` and the client sends it
again signed (which binds the connection again if its credentials are still good); its rights
changed — its cached decisions are dropped, so the next request is decided by the new rules.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from txmq.security.acl.policy import User
from txmq.security.signing import Session

__all__ = ["AuthStrategy", "Binding"]


class AuthStrategy(enum.Enum):
    """How requests are authenticated (RocketMQ 5.3's ``authenticationStrategy``)."""

    #: a TLS connection is authenticated once (by its first signature, or its client
    #: certificate); its later requests need not be signed
    STATEFUL = "stateful"
    #: every request is signed and checked
    STATELESS = "stateless"


class Binding:
    """What a server's guard knows of one connection's authentication (kept in the
    connection's attributes)."""

    __slots__ = (
        "allowed",
        "bound",
        "by_certificate",
        "cert_name",
        "dropped",
        "generation",
        "ident",
        "session",
        "stateful",
        "user",
    )

    def __init__(self, *, stateful: bool, cert_name: str | None, generation: int) -> None:
        #: whether the connection may be bound (the stateful strategy, over TLS)
        self.stateful = stateful
        #: its client certificate's common name (None: none)
        self.cert_name = cert_name
        #: the guard's policy generation this state was checked against
        self.generation = generation
        #: the session of its last signed request (stateless: checked fully at each change)
        self.session: Session | None = None
        #: its user (the last signer's, or the bound one)
        self.user: User | None = None
        #: whether later requests need no signature
        self.bound = False
        #: bound by the client certificate (not by a signature)
        self.by_certificate = False
        #: the prefix and access key of the signature it was bound with (b"": none yet)
        self.ident = b""
        #: why its binding was dropped (None: it was not)
        self.dropped: str | None = None
        #: sends' topics and pulls' (group, topic)s its user was allowed (cleared when the
        #: user or the rules change)
        self.allowed: set[Any] = set()

    def bind(self, user: User, *, ident: bytes = b"", by_certificate: bool = False) -> None:
        self.user = user
        self.bound = True
        self.by_certificate = by_certificate
        self.ident = ident
        self.dropped = None
        self.allowed.clear()

    def drop(self, why: str) -> None:
        self.bound = False
        self.by_certificate = False
        self.ident = b""
        self.session = None
        self.user = None
        self.dropped = why
        self.allowed.clear()

    def how(self) -> str:
        """How the connection was authenticated, as refusals say it."""
        return "its client certificate" if self.by_certificate else "its first signed request"

    def recheck(self, users: Mapping[str, User], generation: int) -> None:
        """The users or rules changed: the bound user looked up again (its binding dropped
        when it is gone or its secret key changed), the cached decisions forgotten."""
        self.generation = generation
        self.allowed.clear()
        user = self.user
        if self.bound and user is not None:
            now = users.get(user.name)
            if now is None:
                self.drop(f"user {user.name!r} was removed")
            elif not self.by_certificate and now.secret_key != user.secret_key:
                self.drop(f"the secret key of {user.name!r} changed")
            else:
                self.user = now
        if not self.bound and self.stateful and self.cert_name is not None:
            named = users.get(self.cert_name)
            if named is not None:
                self.bind(named, by_certificate=True)
