"""Access control without servers: the policy file, deciding, signing and checking frames,
and the table of what each request needs."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import GetTopicRoute, Heartbeat, PullMessage, SendMessage
from txmq.protocol.wire.errors import AuthenticationFailed, NoPermission
from txmq.protocol.wire.frame import FrameDecoder, FrameKind
from txmq.security.acl import Acl, Resource, Rule, topic_resource
from txmq.security.acl.guard import Guard
from txmq.security.acl.rights import needs, unlisted
from txmq.security.client import ClientSecurity, client_security
from txmq.security.credentials import Credentials
from txmq.security.signing import Authenticator, Signer

POLICY = """
[users.orders]
secret_key = "orders-secret"
rules = [
  { resource = "topic:orders", actions = ["pub"] },
  { resource = "topic:orders-*", actions = ["sub"], sources = ["10.0.0.0/8"] },
  { resource = "topic:orders-audit", actions = ["all"], decision = "deny" },
  { resource = "group:billing", actions = ["sub"] },
]

[users.ops]
secret_key = "ops-secret-1"
super = true
"""


@pytest.fixture
def acl() -> Acl:
    return Acl.parse(tomllib.loads(POLICY), "test")


def test_rules_decide_by_the_most_specific_resource(acl: Acl) -> None:
    orders = acl.users["orders"]
    assert orders.may("pub", Resource("topic", "orders"), "127.0.0.1")
    assert not orders.may("sub", Resource("topic", "orders"), "127.0.0.1")
    # the prefix rule holds from its network only
    assert orders.may("sub", Resource("topic", "orders-eu"), "10.1.2.3")
    assert not orders.may("sub", Resource("topic", "orders-eu"), "192.168.1.1")
    # an exact deny beats the prefix allow
    assert not orders.may("sub", Resource("topic", "orders-audit"), "10.1.2.3")
    assert orders.may("sub", Resource("group", "billing"), "::1")
    assert not orders.may("admin", Resource("group", "billing"), "::1")
    assert not orders.may("pub", Resource("topic", "payments"), "127.0.0.1")
    assert acl.users["ops"].may("admin", Resource("cluster"), "1.2.3.4")


def test_retry_and_dead_letter_topics_are_their_groups() -> None:
    assert topic_resource("%RETRY%billing") == Resource("group", "billing")
    assert topic_resource("%DLQ%billing") == Resource("group", "billing")
    assert topic_resource("RMQ_SYS_TRANS_HALF_TOPIC") == Resource("cluster")
    assert topic_resource("orders") == Resource("topic", "orders")


def test_the_file_round_trips_and_changes(tmp_path: Path, acl: Acl) -> None:
    path = tmp_path / "acl.toml"
    acl.save(path)
    assert path.stat().st_mode & 0o777 == 0o600  # it holds secrets
    again = Acl.load(path)
    assert again.dumps() == acl.dumps()
    assert again.users["orders"].rules == acl.users["orders"].rules
    changed = again.with_user("bob", "bob-secret-1").with_rule(
        "bob", Rule.parse({"resource": "group:g*", "actions": "sub"}, "cli")
    )
    changed = changed.without_rule("orders", "topic:orders-audit").without_user("ops")
    changed.save(path)
    loaded = Acl.load(path)
    assert set(loaded.users) == {"orders", "bob"}
    assert loaded.users["bob"].may("sub", Resource("group", "g1"), "127.0.0.1")
    assert len(loaded.users["orders"].rules) == 3


RULE = "[users.a]\nsecret_key = 'long-enough'\nrules = [{{ {} }}]"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[users.a]\nsecret_key = 'short'", "at least 8"),
        (
            RULE.format("resource = 'queue:x', actions = ['pub']"),
            "queue:x",
        ),
        (
            RULE.format("resource = 'topic:x', actions = ['read']"),
            "read",
        ),
        (
            RULE.format("resource = 'topic:x', actions = ['pub'], sources = ['10.0.0.300/8']"),
            "10.0.0.300",
        ),
        ("[users.a]\nsecret_key = 'long-enough'\npassword = 'x'", "password"),
        ("[groups.a]\n", "groups"),
        ("[users.'a b']\nsecret_key = 'long-enough'", "user name"),
        ("users = [", "not valid TOML"),
    ],
)
def test_a_bad_file_says_what_is_wrong(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "acl.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=words.replace(".", r"\.").replace("[", r"\[")):
        Acl.load(path)


def test_a_guard_keeps_its_rules_when_the_file_goes_bad(tmp_path: Path, acl: Acl) -> None:
    path = tmp_path / "acl.toml"
    acl.save(path)
    guard = Guard(path)
    path.write_text("this is not toml [")
    assert guard.reload() is False
    assert set(guard.acl.users) == {"orders", "ops"}
    acl.without_user("ops").save(path)
    assert guard.reload() is True
    assert set(guard.acl.users) == {"orders"}


def _signed_frame(signer: Signer, header: bytes = b"\x81\xa1a\x01", body: bytes = b"body") -> bytes:
    return signer.frame(FrameKind.REQUEST, 10, 7, header, body, 1)


def _decode(data: bytes):  # type: ignore[no-untyped-def]
    (frame,) = FrameDecoder().feed(data)
    return frame


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_signed_frame_authenticates_once() -> None:
    clock = Clock()
    creds = Credentials("orders", "orders-secret")
    signer = Signer(creds, clock=clock)
    auth = Authenticator(lambda ak: creds.secret if ak == "orders" else None, clock=clock)
    data = _signed_frame(signer)
    frame = _decode(data)
    assert (frame.kind, frame.code, frame.request_id, frame.body) == (
        FrameKind.REQUEST,
        10,
        7,
        b"body",
    )
    assert auth.check(frame, "SendMessage").access_key == "orders"
    with pytest.raises(AuthenticationFailed, match="replayed"):
        auth.check(_decode(data), "SendMessage")


def test_requests_may_arrive_out_of_order_but_not_twice() -> None:
    clock = Clock()
    creds = Credentials("orders", "orders-secret")
    signer = Signer(creds, clock=clock)
    auth = Authenticator(lambda ak: creds.secret, clock=clock)
    frames = [_decode(_signed_frame(signer)) for _ in range(5)]
    for i in (4, 0, 2, 1, 3):
        auth.check(frames[i], "x")
    for f in frames:
        with pytest.raises(AuthenticationFailed, match="replayed"):
            auth.check(f, "x")


@pytest.mark.parametrize(
    ("secret", "shift", "words"),
    [
        ("wrong-secret", 0.0, "does not match"),
        ("orders-secret", 61.0, "before this server's clock"),
        ("orders-secret", -61.0, "after this server's clock"),
    ],
)
def test_wrong_secret_and_stale_time_are_refused(secret: str, shift: float, words: str) -> None:
    clock = Clock()
    signer = Signer(Credentials("orders", secret), clock=lambda: clock.now - shift)
    auth = Authenticator(lambda ak: b"orders-secret", clock=clock)
    with pytest.raises(AuthenticationFailed, match=words):
        auth.check(_decode(_signed_frame(signer)), "x")


def test_unsigned_unknown_and_altered_requests_are_refused() -> None:
    creds = Credentials("orders", "orders-secret")
    auth = Authenticator(lambda ak: creds.secret if ak == "orders" else None)
    from txmq.protocol.wire.frame import encode_frame

    with pytest.raises(AuthenticationFailed, match=r"not signed.*TXMQ_ACCESS_KEY"):
        auth.check(_decode(encode_frame(FrameKind.REQUEST, 10, 1, b"", b"x")), "SendMessage")
    with pytest.raises(AuthenticationFailed, match="unknown access key 'bob'"):
        auth.check(_decode(_signed_frame(Signer(Credentials("bob", "bob-secret-1")))), "x")
    good = bytearray(_signed_frame(Signer(creds)))
    for pos in (5, 6, 16, 17, len(good) - 40, len(good) - 3):  # code, header, body, trailer
        bad = bytearray(good)
        bad[pos] ^= 0x01
        try:
            frames = FrameDecoder().feed(bytes(bad))
        except Exception:
            continue  # the frame itself broke: refused before any check
        with pytest.raises(AuthenticationFailed):
            auth.check(frames[0], "x")


class _Conn:
    """A connection as the guard sees it."""

    def __init__(self, name: str = "127.0.0.1:40000") -> None:
        self.name = name
        self.attributes: dict[str, object] = {}


def _send(signer: Signer, topic: str = "orders") -> tuple[object, SendMessage]:
    from txmq.protocol.wire.base import encode

    req = SendMessage(topic=topic, queue_id=0)
    return _decode(signer.frame(FrameKind.REQUEST, SendMessage.CODE, 1, encode(req), b"x", 1)), req


def test_a_connections_later_requests_are_checked_as_fully_as_its_first(
    tmp_path: Path, acl: Acl
) -> None:
    """The guard remembers who signed a connection's requests and which topics it may send
    to; each request's signature, time and number are still checked, a replay on another
    connection is refused, and a change of the file takes effect on the next request."""
    path = tmp_path / "acl.toml"
    acl.save(path)
    guard = Guard(path)
    conn, other = _Conn(), _Conn("127.0.0.1:40001")
    signer = Signer(Credentials("orders", "orders-secret"))
    for _ in range(3):
        frame, req = _send(signer)
        user = guard.authenticate(conn, frame, SendMessage)  # type: ignore[arg-type]
        guard.authorize(user, req, conn)
    assert user.name == "orders"
    with pytest.raises(AuthenticationFailed, match="replayed"):  # the same frame again
        guard.authenticate(other, frame, SendMessage)  # type: ignore[arg-type]
    with pytest.raises(AuthenticationFailed, match="replayed"):
        guard.authenticate(conn, frame, SendMessage)  # type: ignore[arg-type]
    # altered after signing: refused on the connection that knows its signer
    frame, req = _send(signer)
    bad = dataclasses.replace(frame, body=b"y")  # type: ignore[type-var]
    with pytest.raises(AuthenticationFailed, match="does not match"):
        guard.authenticate(conn, bad, SendMessage)  # type: ignore[arg-type]
    # another user's credentials on the same connection: that user, with its own rights
    frame, req = _send(Signer(Credentials("ops", "ops-secret-1")), "payments")
    assert guard.authenticate(conn, frame, SendMessage).name == "ops"  # type: ignore[arg-type]
    frame, req = _send(signer, "payments")
    user = guard.authenticate(conn, frame, SendMessage)  # type: ignore[arg-type]
    with pytest.raises(NoPermission, match="'pub' right on topic:payments"):
        guard.authorize(user, req, conn)
    # the right to send to orders taken away: refused from the next request on
    acl.without_rule("orders", "topic:orders").save(path)
    assert guard.reload()
    frame, req = _send(signer)
    user = guard.authenticate(conn, frame, SendMessage)  # type: ignore[arg-type]
    with pytest.raises(NoPermission, match="'pub' right on topic:orders"):
        guard.authorize(user, req, conn)
    # the user removed: its connection is refused at once
    acl.without_user("orders").save(path)
    assert guard.reload()
    frame, _ = _send(signer)
    with pytest.raises(AuthenticationFailed, match="unknown access key 'orders'"):
        guard.authenticate(conn, frame, SendMessage)  # type: ignore[arg-type]


def test_every_request_class_has_its_needs_named() -> None:
    assert unlisted() == []
    send = needs(SendMessage(topic="orders", queue_id=0))
    assert send == [((Resource("topic", "orders"), "pub"),)]
    retry = needs(SendMessage(topic="%RETRY%billing", queue_id=0))
    assert retry == [((Resource("group", "billing"), "sub"),)]
    pull = needs(PullMessage(topic="orders", queue_id=0, offset=0, group="billing"))
    assert pull == [
        ((Resource("group", "billing"), "sub"),),
        ((Resource("topic", "orders"), "sub"),),
    ]
    assert len(needs(GetTopicRoute(topic="orders"))[0]) == 3
    assert needs(Heartbeat(producers=["tx-group"])) == []


def test_client_settings_come_from_file_env_and_arguments(tmp_path: Path) -> None:
    cfg = tmp_path / "txmq.toml"
    cfg.write_text('[client]\naccess_key = "file-user"\nsecret_key = "file-secret"\n')
    assert client_security(env={"TXMQ_CONFIG": str(cfg)}).access_key == "file-user"
    env = {"TXMQ_CONFIG": str(cfg), "TXMQ_ACCESS_KEY": "env-user", "TXMQ_SECRET_KEY": "env-secret"}
    assert client_security(env=env).access_key == "env-user"
    got = client_security(env=env, access_key="arg-user", secret_key="arg-secret")
    assert got.credentials == Credentials("arg-user", "arg-secret")
    assert "arg-secret" not in repr(got) and "arg-secret" not in repr(got.credentials)
    with pytest.raises(SettingsError, match="without a secret key"):
        ClientSecurity(access_key="a-user")
    with pytest.raises(SettingsError, match="at least 8"):
        ClientSecurity(access_key="a-user", secret_key="short")
