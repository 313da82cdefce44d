"""The stateful authentication strategy without servers: a client's signer stopping and
resuming as the server's notices say, the notices on the wire, and a guard binding TLS
connections (by signature or certificate) and checking them again when its rules change."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from anyio import TypedAttributeProvider
from anyio.streams.tls import TLSAttribute

from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import GetUser, SendMessage
from txmq.protocol.wire.base import encode
from txmq.protocol.wire.errors import AuthenticationFailed, NoPermission
from txmq.protocol.wire.frame import (
    NOTICE_SIGN_AGAIN,
    Frame,
    FrameDecoder,
    FrameKind,
    encode_frame,
)
from txmq.security.acl import Acl, Rule
from txmq.security.acl.binding import AuthStrategy
from txmq.security.acl.guard import Guard
from txmq.security.credentials import Credentials
from txmq.security.signing import Signer, authenticated_notice
from txmq.security.tls import tls_peer
from txmq.server.serving import ConnectionSettings

ALICE = Credentials("alice", "alice-secret")
BOB = Credentials("bob", "bob-secret-1")
SIGN_AGAIN = bytes([NOTICE_SIGN_AGAIN])


def _acl() -> Acl:
    pub = Rule.parse({"resource": "topic:orders", "actions": "pub"}, "t")
    return (
        Acl()
        .with_user("alice", ALICE.secret_key)
        .with_rule("alice", pub)
        .with_user("bob", BOB.secret_key)
    )


class _Ssl:
    def __init__(self, cert: dict[str, Any] | None) -> None:
        self.cert = cert

    def getpeercert(self) -> dict[str, Any] | None:
        return self.cert


class _TlsStream(TypedAttributeProvider):
    """What a guard reads of a server's TLS stream: its SSL object."""

    def __init__(self, common_name: str | None = None) -> None:
        cert = None if common_name is None else {"subject": ((("commonName", common_name),),)}
        self.ssl = _Ssl(cert)

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return {TLSAttribute.ssl_object: lambda: self.ssl}


class _Conn:
    """A connection as the guard sees it (``stream``: a TLS one, or None: plaintext)."""

    def __init__(self, stream: object = None) -> None:
        self.name = "127.0.0.1:40000"
        self.attributes: dict[str, object] = {}
        self.stream = stream


def _frame(data: bytes) -> Frame:
    (frame,) = FrameDecoder().feed(data)
    return frame


def _send(signer: Signer | None, topic: str = "orders") -> tuple[Frame, SendMessage]:
    req = SendMessage(topic=topic, queue_id=0)
    args = (FrameKind.REQUEST, SendMessage.CODE, 1, encode(req), b"x", 1)
    data = signer.frame(*args) if signer is not None else encode_frame(*args)
    return _frame(data), req


@pytest.fixture
def guard(tmp_path: Path) -> Guard:
    path = tmp_path / "acl.toml"
    _acl().save(path)
    return Guard(path)


def _through(guard: Guard, conn: _Conn, signer: Signer | None, topic: str = "orders") -> Frame:
    """A send made on ``conn`` (the guard's checks, the notice handed to the signer)."""
    frame, req = _send(signer, topic)
    try:
        user = guard.authenticate(conn, frame, SendMessage)
        guard.authorize(user, req, conn)
    finally:
        if signer is not None and frame.notice:
            signer.notice(frame.notice)
    return frame


def test_a_stateful_signer_stops_and_resumes_as_told() -> None:
    signer = Signer(ALICE, stateful=True)
    first, _ = _send(signer)
    signer.notice(authenticated_notice(first.auth))
    assert not signer.signing
    assert _send(signer)[0].auth == b""
    oneway = signer.frame(FrameKind.ONEWAY, GetUser.CODE, 2, b"", b"", 1)
    assert _frame(oneway).auth  # (no answer could say "sign again")
    signer.notice(SIGN_AGAIN)
    assert signer.signing
    late, _ = _send(signer)
    # an answer to a request signed before the server dropped the binding: ignored
    signer.notice(authenticated_notice(first.auth))
    assert signer.signing
    signer.notice(authenticated_notice(late.auth))
    assert not signer.signing
    # a signer that is not stateful (plaintext) never stops
    plain = Signer(ALICE)
    plain.notice(authenticated_notice(_send(plain)[0].auth))
    assert plain.signing and _send(plain)[0].auth


def test_a_notice_on_an_answer_reads_as_a_trailer_older_clients_skip() -> None:
    data = encode_frame(FrameKind.RESPONSE, 0, 7, b"", b"body", 1, SIGN_AGAIN)
    frame = _frame(data)
    assert (frame.kind, frame.request_id, frame.body, frame.auth) == (
        FrameKind.RESPONSE,
        7,
        b"body",
        SIGN_AGAIN,
    )
    assert encode_frame(FrameKind.RESPONSE, 0, 7, b"", b"body", 1, b"") == encode_frame(
        FrameKind.RESPONSE, 0, 7, b"", b"body", 1
    )


def test_a_tls_connection_is_bound_by_its_first_signature(guard: Guard) -> None:
    conn, signer = _Conn(_TlsStream()), Signer(ALICE, stateful=True)
    first = _through(guard, conn, signer)
    assert first.notice and not signer.signing
    assert _through(guard, conn, None).notice == b""  # unsigned: alice's
    with pytest.raises(NoPermission, match="'alice' has no 'pub' right on topic:billing"):
        _through(guard, conn, None, "billing")
    # a signature by the same signer (as an old client keeps making): taken, and answered
    # "authenticated" again
    signer.signing = True
    assert _through(guard, conn, signer).notice and not signer.signing
    with pytest.raises(AuthenticationFailed, match="signed by 'bob', but this TLS connection"):
        _through(guard, conn, Signer(BOB))
    # plaintext: never bound (each request signed)
    plain = _Conn()
    assert _through(guard, plain, Signer(ALICE, stateful=True)).notice == b""
    with pytest.raises(AuthenticationFailed, match="is not signed"):
        _through(guard, plain, None)


def test_a_change_of_the_rules_reaches_a_bound_connection(guard: Guard) -> None:
    conn, signer = _Conn(_TlsStream()), Signer(ALICE, stateful=True)
    _through(guard, conn, signer)
    assert conn.attributes["acl_user"] == "alice"
    # a right taken away: denied at once
    guard.replace(_acl().without_rule("alice", "topic:orders"))
    with pytest.raises(NoPermission):
        _through(guard, conn, None)
    # the secret key changed: the binding dropped, an unsigned request told to sign again
    guard.replace(_acl().with_user("alice", "alice-secret-2"))
    with pytest.raises(AuthenticationFailed, match="the secret key of 'alice' changed"):
        _through(guard, conn, signer)
    assert signer.signing and "acl_user" not in conn.attributes
    with pytest.raises(AuthenticationFailed, match="does not match"):
        _through(guard, conn, signer)
    # the key back as it was: signing binds the connection again
    guard.replace(_acl())
    assert _through(guard, conn, signer).notice and not signer.signing
    guard.replace(_acl().without_user("alice"))
    with pytest.raises(AuthenticationFailed, match="user 'alice' was removed"):
        _through(guard, conn, None)


def test_a_client_certificate_binds_the_connection_to_its_user(guard: Guard) -> None:
    conn = _Conn(_TlsStream("alice"))
    _through(guard, conn, None)
    assert conn.attributes["acl_user"] == "alice"
    with pytest.raises(AuthenticationFailed, match=r"\(by its client certificate\)"):
        _through(guard, conn, Signer(BOB))
    assert _through(guard, conn, Signer(ALICE, stateful=True)).notice  # checked once
    # a certificate naming no user: signing, as before
    stranger = _Conn(_TlsStream("txmq test client"))
    with pytest.raises(AuthenticationFailed, match="is not signed"):
        _through(guard, stranger, None)
    _through(guard, stranger, Signer(ALICE))
    # the stateless strategy: certificates name no one, every request is signed
    stateless = Guard(guard.path, strategy=AuthStrategy.STATELESS)
    with pytest.raises(AuthenticationFailed, match="is not signed"):
        _through(stateless, _Conn(_TlsStream("alice")), None)
    tls = _Conn(_TlsStream())
    signer = Signer(ALICE, stateful=True)
    assert _through(stateless, tls, signer).notice == b"" and signer.signing


def test_tls_peer_reads_one_common_name() -> None:
    assert tls_peer(object()) is None
    stream = _TlsStream("alice")
    peer = tls_peer(stream)
    assert peer is not None and peer.common_name == "alice"
    stream.ssl.cert = {"subject": ((("commonName", "a"),), (("commonName", "b"),))}
    peer = tls_peer(stream)
    assert peer is not None and peer.common_name is None  # two: no one


def test_the_strategy_setting() -> None:
    assert ConnectionSettings().acl_auth_strategy is AuthStrategy.STATEFUL
    settings = ConnectionSettings(acl_auth_strategy="Stateless")  # type: ignore[arg-type]
    assert settings.acl_auth_strategy is AuthStrategy.STATELESS
    with pytest.raises(SettingsError, match="'stateful' or 'stateless', not 'sometimes'"):
        ConnectionSettings(acl_auth_strategy="sometimes")  # type: ignore[arg-type]
