"""TLS (txmq/tls.py): the servers' and clients' contexts, clear errors for files that
cannot be used, the settings and flags that turn it on, and what a TLS server does with a
plaintext client, a client it does not trust and a client that does not trust it (over
loopback sockets in this process: no broker)."""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest
from anyio.abc import SocketAttribute
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from tests.tls_support import certs, other
from txmq.admin.client import AdminClient
from txmq.broker.state.config import BrokerConfig
from txmq.cli.main import build_parser, main
from txmq.cli.options import tls_overrides
from txmq.client.core import BrokerClient
from txmq.client.producer import Producer
from txmq.namesrv import ControllerConfig, NamesrvConfig
from txmq.protocol.settings import SettingsError
from txmq.protocol.wire.base import ErrorAnswer, decode
from txmq.protocol.wire.errors import BrokerUnavailable, ResponseCode
from txmq.protocol.wire.frame import Frame, FrameDecoder, FrameKind, encode_frame
from txmq.security.certs import CertFiles
from txmq.security.client import ClientSecurity, client_security
from txmq.security.tls import (
    PLAINTEXT_REFUSED,
    accept_tls,
    client_context,
    client_handshake,
    server_context,
)
from txmq.server.serving import warn_if_exposed

__all__ = ["certs", "other"]  # the fixtures, used by name

pytestmark = pytest.mark.anyio


# -- contexts and files -----------------------------------------------------------------------


def test_test_certificates_name_loopback_and_serve_both_ways(certs: CertFiles) -> None:
    for path in (certs.ca, certs.cert, certs.key, certs.client_cert, certs.client_key):
        assert path.stat().st_size > 0
    assert certs.key.stat().st_mode & 0o077 == 0  # keys readable by their owner only
    info = ssl._ssl._test_decode_cert(str(certs.cert))  # type: ignore[attr-defined]
    assert ("IP Address", "127.0.0.1") in info["subjectAltName"]
    assert ("DNS", "localhost") in info["subjectAltName"]


def test_server_context_requires_client_certificates_only_with_a_ca(certs: CertFiles) -> None:
    plain = server_context(certs.cert, certs.key)
    assert plain.verify_mode == ssl.CERT_NONE
    assert plain.minimum_version == ssl.TLSVersion.TLSv1_2
    mutual = server_context(certs.cert, certs.key, certs.ca)
    assert mutual.verify_mode == ssl.CERT_REQUIRED
    assert mutual.minimum_version == ssl.TLSVersion.TLSv1_2


def test_client_context_checks_the_server_and_its_name(certs: CertFiles) -> None:
    ctx = client_context(certs.ca, certs.client_cert, certs.client_key)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert client_context().verify_mode == ssl.CERT_REQUIRED  # the system's authorities


def test_unusable_files_are_named(certs: CertFiles, other: CertFiles, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(SettingsError, match=f"cannot read the TLS certificate {missing}"):
        server_context(missing, certs.key)
    with pytest.raises(SettingsError, match=f"cannot read the TLS key {missing}"):
        server_context(certs.cert, missing)
    with pytest.raises(SettingsError, match=f"{other.key} does not belong to .*{certs.cert}"):
        server_context(certs.cert, other.key)
    with pytest.raises(SettingsError, match=f"TLS CA file {certs.key} is not a PEM certificate"):
        server_context(certs.cert, certs.key, certs.key)
    with pytest.raises(SettingsError, match=f"TLS CA file {missing}"):
        client_context(missing)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello")
    with pytest.raises(SettingsError, match=f"TLS certificate {garbage} is not a PEM"):
        server_context(garbage, certs.key)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_text(
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n"
    )
    with pytest.raises(SettingsError, match=f"TLS key {encrypted} is encrypted"):
        server_context(certs.cert, encrypted)
    with pytest.raises(SettingsError, match="go together"):
        client_context(certs.ca, cert=certs.client_cert)


# -- settings ---------------------------------------------------------------------------------


def test_servers_settings_turn_tls_on(certs: CertFiles, tmp_path: Path) -> None:
    off = BrokerConfig(store=tmp_path / "s")
    assert off.server_ssl_context() is None and off.server_tls() is None
    assert not off.peer_security().uses_tls
    on = BrokerConfig(store=tmp_path / "s", tls_cert=str(certs.cert), tls_key=str(certs.key))  # type: ignore[arg-type]
    assert on.tls_cert == certs.cert  # a str in code becomes a path
    ctx = on.server_ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE
    peer = on.peer_security()
    # the broker checks its peers against the system's authorities (no tls_ca), and
    # shows its own certificate to those that ask
    assert peer.tls and peer.tls_ca is None
    assert (peer.tls_cert, peer.tls_key) == (certs.cert, certs.key)
    env = {
        "TXMQ_NAMESRV_TLS_CERT": str(certs.cert),
        "TXMQ_NAMESRV_TLS_KEY": str(certs.key),
        "TXMQ_NAMESRV_TLS_CA": str(certs.ca),
    }
    ns = NamesrvConfig.load(env=env)
    ctx = ns.server_ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED
    controller = ControllerConfig(
        store=tmp_path / "c", tls_cert=certs.cert, tls_key=certs.key, tls_ca=certs.ca
    )
    assert controller.server_tls() is not None


def test_servers_settings_errors(certs: CertFiles, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="tls_cert and tls_key go together"):
        NamesrvConfig(tls_cert=certs.cert)
    with pytest.raises(SettingsError, match=r"tls_ca .* needs TLS on"):
        NamesrvConfig(tls_ca=certs.ca)
    missing = tmp_path / "gone.key"
    with pytest.raises(SettingsError, match=f"cannot read the TLS key {missing}"):
        BrokerConfig.load(store=tmp_path / "s", tls_cert=certs.cert, tls_key=missing)


def test_broker_and_namesrv_flags(certs: CertFiles, tmp_path: Path) -> None:
    flags = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key), "--tls-ca", str(certs.ca)]
    parser = build_parser()
    for command in (["broker", "start"], ["namesrv", "start"], ["controller", "start"]):
        args = parser.parse_args([*command, *flags])
        assert tls_overrides(args) == {
            "tls_cert": certs.cert,
            "tls_key": certs.key,
            "tls_ca": certs.ca,
        }
    cfg = BrokerConfig.load(store=tmp_path / "s", **tls_overrides(parser.parse_args(
        ["broker", "start", *flags])))  # fmt: skip
    assert cfg.server_tls() is not None and cfg.peer_security().tls_ca == certs.ca


def test_a_bad_tls_flag_is_one_line(
    certs: CertFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.pem"
    store = tmp_path / "store"
    code = main(
        ["broker", "start", "--store", str(store), "--tls-cert", str(missing),
         "--tls-key", str(certs.key)]
    )  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("txmq: error: cannot read the TLS certificate") and str(missing) in err
    assert len(err.strip().splitlines()) == 1
    code = main(["namesrv", "start", "--port", "0", "--tls-cert", str(certs.cert)])
    assert code == 1
    assert "tls_cert and tls_key go together" in capsys.readouterr().err


def test_clients_read_tls_from_the_environment(
    certs: CertFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not BrokerClient("127.0.0.1:1").security.uses_tls  # off by default
    monkeypatch.setenv("TXMQ_TLS", "1")
    monkeypatch.setenv("TXMQ_TLS_CA", str(certs.ca))
    for client in (Producer("127.0.0.1:1"), AdminClient("127.0.0.1:1")):
        assert client.security.tls and client.security.tls_ca == certs.ca
    # constructor arguments win over the environment; a whole ClientSecurity wins over all
    assert not Producer("127.0.0.1:1", tls=False, tls_ca=None).security.tls
    given = ClientSecurity(tls=True)
    assert Producer("127.0.0.1:1", security=given).security is given
    monkeypatch.setenv("TXMQ_TLS_CERT", str(certs.client_cert))
    with pytest.raises(SettingsError, match="tls_cert and tls_key go together"):
        client_security()


# -- the exposure warning ---------------------------------------------------------------------


def test_warn_if_exposed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "txmq.serving"):
        for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
            warn_if_exposed("broker", host, tls=False, acl=False)
        warn_if_exposed("broker", "0.0.0.0", tls=True, acl=True)
        assert caplog.records == []
        warn_if_exposed("name server", "0.0.0.0", tls=False, acl=True)
        warn_if_exposed("broker", "10.1.2.3", tls=True, acl=False)
        warn_if_exposed("broker", "10.1.2.4", tls=False, acl=False)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith("name server listens on 0.0.0.0 without TLS")
    assert "access control" not in lines[0]
    assert lines[1].startswith("broker listens on 10.1.2.3 without access control")
    assert "--acl FILE" in lines[1] and "TLS" not in lines[1]
    assert "without access control" in lines[2] and "plaintext" in lines[2]


# -- accepting connections --------------------------------------------------------------------


Serve = Callable[[anyio.abc.SocketStream], Awaitable[None]]
Outcomes = tuple[MemoryObjectSendStream[object], MemoryObjectReceiveStream[object]]


@pytest.fixture
def outcomes() -> Iterator[Outcomes]:
    """What the server side of each connection came to, in the order they ended."""
    tell, results = anyio.create_memory_object_stream[object](16)
    with tell, results:
        yield tell, results


@asynccontextmanager
async def listening(serve: Serve) -> AsyncIterator[int]:
    """A loopback listener that runs ``serve`` for each connection; its port."""
    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as listener,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(listener.serve, serve)
        yield listener.extra(SocketAttribute.local_port)
        tg.cancel_scope.cancel()


async def read_frames(stream: anyio.abc.ByteStream) -> list[Frame]:
    """Every frame the peer sends until it closes."""
    decoder, frames = FrameDecoder(), []
    with anyio.fail_after(10):
        while True:
            try:
                frames += decoder.feed(await stream.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return frames


async def test_a_plaintext_client_is_told_to_use_tls(
    certs: CertFiles, caplog: pytest.LogCaptureFixture, outcomes: Outcomes
) -> None:
    ctx = server_context(certs.cert, certs.key)
    tell, results = outcomes

    async def serve(stream: anyio.abc.SocketStream) -> None:
        await tell.send(await accept_tls(stream, ctx, peer="the-peer", timeout=5))

    async with listening(serve) as port:
        # a oneway request and a request in one write: the request's id is answered
        sent = encode_frame(FrameKind.ONEWAY, 34, 6, b"") + encode_frame(
            FrameKind.REQUEST, 11, 77, b""
        )
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(sent)
            frames = await read_frames(stream)
        # a client that sent less than a frame's prefix is answered with request id 0
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"GET /")
            short = await read_frames(stream)
        with anyio.fail_after(5):
            ended = [await results.receive() for _ in range(2)]
    assert len(frames) == 1
    answer = frames[0]
    assert answer.kind == FrameKind.RESPONSE and answer.request_id == 77
    assert answer.code == ResponseCode.BAD_REQUEST
    assert decode(ErrorAnswer, answer.header).error == PLAINTEXT_REFUSED
    assert [(f.request_id, f.code) for f in short] == [(0, ResponseCode.BAD_REQUEST)]
    assert ended == [None, None]
    refused = [r for r in caplog.records if "plaintext" in r.getMessage()]
    assert len(refused) == 2 and "the-peer" in refused[0].getMessage()


async def test_tls_clients_trusted_or_not(
    certs: CertFiles, other: CertFiles, caplog: pytest.LogCaptureFixture, outcomes: Outcomes
) -> None:
    ctx = server_context(certs.cert, certs.key, certs.ca)  # client certificates required
    tell, results = outcomes

    async def serve(stream: anyio.abc.SocketStream) -> None:
        tls = await accept_tls(stream, ctx, peer="peer", timeout=5)
        await tell.send(tls is not None)
        if tls is not None:
            async with tls:
                await tls.send(b"echo:" + await tls.receive())

    async with listening(serve) as port:
        address = f"127.0.0.1:{port}"

        async def connect(client: ssl.SSLContext, host: str = "127.0.0.1") -> bytes:
            raw = await anyio.connect_tcp("127.0.0.1", port)
            stream = await client_handshake(raw, client, host, address, 5.0)
            async with stream:
                await stream.send(b"hi")
                return await stream.receive()

        good = client_context(certs.ca, certs.client_cert, certs.client_key)
        assert await connect(good) == b"echo:hi"
        assert await connect(good, "localhost") == b"echo:hi"  # the DNS name of the SAN
        with pytest.raises(BrokerUnavailable, match="CERTIFICATE_VERIFY_FAILED") as wrong_ca:
            await connect(client_context(other.ca, certs.client_cert, certs.client_key))
        assert wrong_ca.value.sent is False
        with pytest.raises(BrokerUnavailable, match=r"CERTIFICATE_VERIFY_FAILED.*mismatch"):
            await connect(good, "127.0.0.9")  # not a name in the server's certificate
        with pytest.raises(BrokerUnavailable, match="refused this client's certificate"):
            await connect(client_context(certs.ca))  # no client certificate
        with pytest.raises(BrokerUnavailable, match="refused this client's certificate"):
            await connect(client_context(certs.ca, other.client_cert, other.client_key))
        with anyio.fail_after(5):
            accepted = [await results.receive() for _ in range(6)]
    assert (accepted.count(True), accepted.count(False)) == (2, 4)
    failed = [r for r in caplog.records if r.getMessage().startswith("TLS handshake with peer")]
    assert len(failed) == 2 and all(r.levelno == logging.WARNING for r in failed)
    assert all(r.exc_info is None for r in caplog.records)  # one line each, no traceback


async def test_a_silent_connection_is_closed_after_the_handshake_timeout(
    certs: CertFiles, outcomes: Outcomes
) -> None:
    ctx = server_context(certs.cert, certs.key)
    tell, results = outcomes

    async def serve(stream: anyio.abc.SocketStream) -> None:
        await tell.send(await accept_tls(stream, ctx, peer="slow", timeout=0.3))

    async with listening(serve) as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            with anyio.fail_after(10), pytest.raises((anyio.EndOfStream, OSError)):
                await stream.receive()  # closed by the server, nothing said
        with anyio.fail_after(5):
            assert await results.receive() is None


async def test_a_tls_client_of_a_plaintext_server_gets_a_clear_error(certs: CertFiles) -> None:
    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.receive()
            await stream.send(encode_frame(FrameKind.RESPONSE, 7, 0, b""))

    async with listening(serve) as port:
        raw = await anyio.connect_tcp("127.0.0.1", port)
        with pytest.raises(BrokerUnavailable, match=r"TLS handshake with .* failed") as failed:
            await client_handshake(raw, client_context(certs.ca), "127.0.0.1", "x:1", 5.0)
    assert failed.value.sent is False
