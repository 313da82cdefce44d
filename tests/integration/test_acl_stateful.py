"""The stateful authentication strategy on real broker processes: a TLS connection is
authenticated once (its first signed request, or a client certificate naming a user) and its
later requests go unsigned; another user's signature on it is refused; a change of the users
or rules takes effect on it at once; plaintext connections (and ``--acl-auth-strategy
stateless``) stay signed request by request.

What is written on each connection is recorded, so the tests count the signed frames a
client sent rather than trust the client's word."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from tests.acl_support import SECRETS, as_user, policy, secured_broker
from tests.conftest import BrokerProcess
from tests.tls_support import certs
from txmq import AdminClient, AuthenticationFailed, Message, NoPermission, Producer
from txmq.protocol.connection import Connection, FrameSigner
from txmq.protocol.peer import parse_address
from txmq.protocol.wire import Frame, FrameDecoder, GetUser, SendMessage
from txmq.security.certs import CertFiles, make_client_cert
from txmq.security.client import ClientSecurity
from txmq.security.credentials import Credentials
from txmq.security.signing import Signer
from txmq.security.tls import Wrapped

__all__ = ["certs"]  # the fixture, used by name

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

POLICY = policy(
    {
        "alice": [("topic:orders*", "pub")],
        "bob": [("topic:billing", "pub")],
    }
)


class Recorded(Wrapped):
    """A client's stream that keeps what was written on it (the request frames)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        super().__init__(stream)
        self.sent = bytearray()

    async def send(self, item: bytes) -> None:
        self.sent += item
        await self.stream.send(item)

    def frames(self) -> list[Frame]:
        return FrameDecoder().feed(bytes(self.sent))

    def signed(self) -> list[bool]:
        """Whether each request written was signed (carried an auth trailer)."""
        return [bool(f.auth) for f in self.frames()]


@asynccontextmanager
async def connected(
    address: str, security: ClientSecurity, signer: FrameSigner | None = None
) -> AsyncIterator[tuple[Connection, Recorded]]:
    """One connection as txmq's clients make it (TLS when ``security`` says; its signer
    from ``security`` unless ``signer``), recording what it writes."""
    host, port = parse_address(address)
    stream: anyio.abc.ByteStream = await anyio.connect_tcp(host, port)
    stream = await security.secure(stream, host, address, 10)
    wire = Recorded(stream)
    conn = Connection(wire, name=address, signer=signer or security.signer())
    async with anyio.create_task_group() as tg:
        tg.start_soon(conn.run)
        try:
            yield conn, wire
        finally:
            conn.close()
            tg.cancel_scope.cancel()


def tls(certs: CertFiles, user: str | None = None, **more: Any) -> ClientSecurity:
    """A TLS client trusting the test CA, signing as ``user`` (None: not signing)."""
    options: dict[str, Any] = {**(as_user(user) if user else {}), **more}
    return ClientSecurity(tls=True, tls_ca=certs.ca, **options)


async def whoami(conn: Connection) -> str:
    return (await conn.call(GetUser())).header.name


async def send(conn: Connection, topic: str = "orders") -> None:
    await conn.call(SendMessage(topic=topic, queue_id=0), b"x")


def tls_env(certs: CertFiles, *, client_ca: bool = False) -> dict[str, str]:
    env = {"TXMQ_BROKER_TLS_CERT": str(certs.cert), "TXMQ_BROKER_TLS_KEY": str(certs.key)}
    if client_ca:
        env["TXMQ_BROKER_TLS_CA"] = str(certs.ca)
    return env


@pytest.fixture
def tls_broker(
    tmp_path: Path, broker_process: Callable[..., BrokerProcess], certs: CertFiles
) -> BrokerProcess:
    """ACL and TLS, the strategy left at its default (stateful)."""
    return secured_broker(broker_process, tmp_path, POLICY, tls_env(certs))


async def test_a_tls_connection_is_authenticated_once_then_goes_unsigned(
    tls_broker: BrokerProcess, certs: CertFiles
) -> None:
    address = tls_broker.address
    async with connected(address, tls(certs, "alice")) as (conn, wire):
        assert await whoami(conn) == "alice"  # signed: the answer says "authenticated"
        for _ in range(20):
            await send(conn)
        assert await whoami(conn) == "alice"
        assert wire.signed() == [True] + [False] * 21
        signer = conn.signer
        assert isinstance(signer, Signer) and signer.signed == 1 and not signer.signing
        # the broker did not just stop checking: it still refuses what alice may not do
        with pytest.raises(NoPermission, match="'alice' has no 'pub' right on topic:billing"):
            await send(conn, "billing")
        # another user's signature on alice's connection: refused, one line with a hint
        conn.signer = Signer(Credentials("bob", SECRETS["bob"]))
        with pytest.raises(
            AuthenticationFailed,
            match=r"signed by 'bob', but this TLS connection is authenticated as 'alice' "
            r"\(by its first signed request\): use a connection of its own for each user",
        ):
            await send(conn, "billing")
    # an unsigned request on a connection no one authenticated: refused
    async with connected(address, tls(certs)) as (conn, wire):
        with pytest.raises(AuthenticationFailed, match="is not signed"):
            await whoami(conn)
    # an old client, which signs every request, is served as before
    old = Signer(Credentials("alice", SECRETS["alice"]))
    async with connected(address, tls(certs), signer=old) as (conn, wire):
        for _ in range(5):
            await send(conn)
        assert wire.signed() == [True] * 5 and old.signed == 5
    # the real clients: a producer over TLS sends, unsigned after its first requests
    async with Producer(address, security=tls(certs, "alice")) as producer:
        for i in range(10):
            await producer.send(Message("orders", b"m-%d" % i))


async def test_a_change_of_the_users_or_rules_reaches_bound_connections_at_once(
    tls_broker: BrokerProcess, certs: CertFiles
) -> None:
    address = tls_broker.address
    async with (
        AdminClient(address, security=tls(certs, "ops")) as admin,
        connected(address, tls(certs, "alice")) as (conn, wire),
    ):
        await send(conn)
        await send(conn)
        assert wire.signed() == [True, False]
        # a right taken away: the very next (unsigned) request is denied
        await admin.delete_rule("alice", "topic:orders*")
        with pytest.raises(NoPermission, match="'alice' has no 'pub' right on topic:orders"):
            await send(conn)
        await admin.add_rule("alice", "topic:orders*", ["pub"])
        await send(conn)
        assert wire.signed()[-2:] == [False, False]  # rights changed: still bound

        # the user removed: the binding is dropped; the unsigned request is refused with
        # "sign again", and the connection sends it again signed: unknown now
        await admin.delete_user("alice")
        before = len(wire.signed())
        with pytest.raises(AuthenticationFailed, match="unknown access key 'alice'"):
            await send(conn)
        assert wire.signed()[before:] == [False, True]
        # made again (same secret key): the connection, signing again, is bound again
        await admin.create_user("alice", SECRETS["alice"])
        await admin.add_rule("alice", "topic:orders*", ["pub"])
        before = len(wire.signed())
        await send(conn)
        await send(conn)
        assert wire.signed()[before:] == [True, False]

        # the secret key changed: the binding is dropped, and the old key fails
        await admin.update_user("alice", secret_key="alice-secret-2")
        before = len(wire.signed())
        with pytest.raises(AuthenticationFailed, match="signature of 'alice' does not match"):
            await send(conn)
        assert wire.signed()[before:] == [False, True]
        with pytest.raises(AuthenticationFailed, match="does not match"):
            await send(conn)  # (still signing: the broker never said authenticated)
        assert wire.signed()[-1] is True
    new_key = ClientSecurity(
        tls=True, tls_ca=certs.ca, access_key="alice", secret_key="alice-secret-2"
    )
    async with connected(address, new_key) as (conn, wire):
        await send(conn)
        await send(conn)
        assert wire.signed() == [True, False]


async def test_a_changed_file_reaches_bound_connections(
    tls_broker: BrokerProcess, certs: CertFiles, tmp_path: Path
) -> None:
    """The file edited by hand (read again within a second): the same as an admin command."""
    from txmq.security.acl import Acl

    path = tmp_path / "acl.toml"
    async with connected(tls_broker.address, tls(certs, "alice")) as (conn, wire):
        await send(conn)
        Acl.load(path).without_rule("alice", "topic:orders*").save(path)
        with anyio.fail_after(20):
            while True:
                try:
                    await send(conn)
                except NoPermission:
                    break
                await anyio.sleep(0.1)
        assert not any(wire.signed()[1:])


async def test_plaintext_connections_sign_every_request(
    tmp_path: Path, broker_process: Callable[..., BrokerProcess]
) -> None:
    plain = secured_broker(broker_process, tmp_path, POLICY)
    # even a client that would stop signing (as over TLS) is never told it may
    signer = Signer(Credentials("alice", SECRETS["alice"]), stateful=True)
    async with connected(plain.address, ClientSecurity(), signer=signer) as (conn, wire):
        for _ in range(5):
            await send(conn)
        assert wire.signed() == [True] * 5 and signer.signing
        conn.signer = None
        with pytest.raises(AuthenticationFailed, match="is not signed"):
            await send(conn)
        # another user's signature on the same plaintext connection: that user's request
        conn.signer = Signer(Credentials("bob", SECRETS["bob"]))
        await send(conn, "billing")


async def test_the_stateless_strategy_signs_every_request_over_tls(
    tmp_path: Path, broker_process: Callable[..., BrokerProcess], certs: CertFiles
) -> None:
    env = {**tls_env(certs), "TXMQ_BROKER_ACL_AUTH_STRATEGY": "stateless"}
    stateless = secured_broker(broker_process, tmp_path, POLICY, env)
    async with connected(stateless.address, tls(certs, "alice")) as (conn, wire):
        for _ in range(5):
            await send(conn)
        assert wire.signed() == [True] * 5
        conn.signer = None
        with pytest.raises(AuthenticationFailed, match="is not signed"):
            await send(conn)


async def test_a_client_certificate_authenticates_its_user(
    tmp_path: Path, broker_process: Callable[..., BrokerProcess], certs: CertFiles
) -> None:
    env = tls_env(certs, client_ca=True)
    bp = secured_broker(broker_process, tmp_path, POLICY, env)
    alice_cert, alice_key = make_client_cert(certs, tmp_path / "clients", "alice")
    alice: dict[str, Any] = {"tls_cert": alice_cert, "tls_key": alice_key}
    # a certificate of CN=alice, no credentials: alice, from the first request
    async with connected(bp.address, tls(certs, **alice)) as (conn, wire):
        assert await whoami(conn) == "alice"
        await send(conn)
        with pytest.raises(NoPermission, match="'alice' has no 'pub' right on topic:billing"):
            await send(conn, "billing")
        assert not any(wire.signed())
    # alice's certificate and alice's credentials: the first signature is checked, then
    # nothing is signed
    async with connected(bp.address, tls(certs, "alice", **alice)) as (conn, wire):
        await send(conn)
        await send(conn)
        assert wire.signed() == [True, False]
    # alice's certificate, bob's credentials: refused
    async with connected(bp.address, tls(certs, "bob", **alice)) as (conn, wire):
        with pytest.raises(
            AuthenticationFailed,
            match="signed by 'bob', but this TLS connection is authenticated as 'alice' "
            r"\(by its client certificate\)",
        ):
            await send(conn, "billing")
    # a certificate naming no user (the test CA's client certificate): signing, as before
    stranger: dict[str, Any] = {"tls_cert": certs.client_cert, "tls_key": certs.client_key}
    async with connected(bp.address, tls(certs, **stranger)) as (conn, wire):
        with pytest.raises(AuthenticationFailed, match="is not signed"):
            await send(conn)
    async with connected(bp.address, tls(certs, "bob", **stranger)) as (conn, wire):
        assert await whoami(conn) == "bob"
        await send(conn, "billing")
        assert wire.signed() == [True, False]
    # the real clients: a producer with alice's certificate only
    async with Producer(bp.address, security=tls(certs, **alice)) as producer:
        await producer.send(Message("orders", b"by certificate"))
