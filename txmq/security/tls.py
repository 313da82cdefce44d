"""TLS for every txmq endpoint: the servers' and the clients' contexts, accepting a TLS
connection (and telling a plaintext client, in its own protocol, to use TLS).  Test
certificates: :mod:`txmq.security.certs`.

A server with ``tls_cert``/``tls_key`` speaks TLS 1.2 or later on its port; with
``tls_ca`` it also requires a client certificate signed by that authority.  A client with
``tls=True`` checks the server's certificate (against ``tls_ca``, else the system's
authorities) and the host name it connects to; ``tls_cert``/``tls_key`` are the
certificate it shows a server that asks for one.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio import TypedAttributeProvider
from anyio.streams.tls import TLSAttribute, TLSStream

from txmq.protocol.settings import SettingsError
from txmq.protocol.wire.base import ErrorAnswer
from txmq.protocol.wire.errors import BrokerUnavailable, ResponseCode
from txmq.protocol.wire.frame import PREFIX, FrameKind, encode_frame

__all__ = [
    "PLAINTEXT_REFUSED",
    "ServerTls",
    "TlsPeer",
    "Wrapped",
    "accept_tls",
    "client_context",
    "client_handshake",
    "grpc_channel_credentials",
    "server_context",
    "tls_peer",
]

log = logging.getLogger("txmq.tls")

#: the first byte of every TLS connection (a handshake record)
TLS_HANDSHAKE = 0x16
#: what a TLS server answers a plaintext txmq request
PLAINTEXT_REFUSED = "this server requires TLS: connect with tls=True (TXMQ_TLS=1)"
#: after refusing a plaintext client: how long its remaining bytes are read (so that
#: closing sends FIN, not a reset that could lose the answer), and how many
_DRAIN_S = 2.0
_DRAIN_BYTES = 1024 * 1024
_CERT = "-----BEGIN CERTIFICATE-----"
#: TLS 1.3: how long a client waits, after its handshake, for the server to accept or
#: refuse its certificate (a txmq server answers within a round trip)
VERDICT_S = 2.0


# -- contexts ------------------------------------------------------------------------------


def _readable(path: Path, what: str, marker: str, kind: str) -> str:
    """The PEM text of ``path``; SettingsError naming the file when it cannot be read or
    holds no ``marker`` (it is no PEM ``kind``)."""
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise SettingsError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if marker not in text:
        raise SettingsError(f"the {what} {path} is not a PEM {kind} (no {marker!r} in it)")
    return text


def _load_pair(ctx: ssl.SSLContext, cert: Path, key: Path) -> None:
    _readable(cert, "TLS certificate", _CERT, "certificate")
    key_text = _readable(key, "TLS key", "PRIVATE KEY-----", "private key")
    if "ENCRYPTED" in key_text:
        raise SettingsError(
            f"the TLS key {key} is encrypted: give an unencrypted key file (readable by "
            "the server's user only)"
        )

    def no_password() -> bytes:  # never prompt on a terminal
        return b""

    try:
        ctx.load_cert_chain(str(cert), str(key), password=no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise SettingsError(
                f"the TLS key {key} does not belong to the certificate {cert}"
            ) from None
        raise SettingsError(
            f"cannot use the TLS certificate {cert} with the key {key}: {_reason(exc)}"
        ) from None
    except OSError as exc:
        raise SettingsError(
            f"cannot read the TLS certificate {cert} or key {key}: {exc.strerror or exc}"
        ) from None


def _load_ca(ctx: ssl.SSLContext, ca: Path) -> None:
    _readable(ca, "TLS CA file", _CERT, "certificate")
    try:
        ctx.load_verify_locations(cafile=str(ca))
    except (ssl.SSLError, OSError) as exc:
        raise SettingsError(f"cannot use the TLS CA file {ca}: {_reason(exc)}") from None


def server_context(
    cert: Path | str, key: Path | str, ca: Path | str | None = None
) -> ssl.SSLContext:
    """A server's context: TLS 1.2 or later, its certificate and key; with ``ca``, clients
    must show a certificate signed by it.  SettingsError names a file that is missing,
    unreadable, not PEM, or a key that does not match its certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_pair(ctx, Path(cert), Path(key))
    if ca is not None:
        _load_ca(ctx, Path(ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(
    ca: Path | str | None = None, cert: Path | str | None = None, key: Path | str | None = None
) -> ssl.SSLContext:
    """A client's context: TLS 1.2 or later, the server's certificate checked against
    ``ca`` (else the system's authorities) and the host name; ``cert``/``key``: the
    client's own certificate, for servers that ask for one."""
    if (cert is None) != (key is None):
        raise SettingsError("tls_cert and tls_key go together: set both or neither")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca is not None:
        _load_ca(ctx, Path(ca))
    if cert is not None and key is not None:
        _load_pair(ctx, Path(cert), Path(key))
    return ctx


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS files (``tls_cert``, ``tls_key`` and, to require client
    certificates, ``tls_ca``)."""

    cert: Path
    key: Path
    ca: Path | None = None

    def context(self) -> ssl.SSLContext:
        return server_context(self.cert, self.key, self.ca)

    def grpc_credentials(self) -> Any:
        """The same for a gRPC server (``grpc.ssl_server_credentials``)."""
        import grpc

        self.context()  # the same checks and errors as txmq's own port
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes() if self.ca is not None else None,
            require_client_auth=self.ca is not None,
        )


def grpc_channel_credentials(
    ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> Any:
    """A gRPC client's TLS credentials (``grpc.ssl_channel_credentials``), the files
    checked as :func:`client_context` checks them."""
    import grpc

    client_context(ca, cert, key)
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes() if ca is not None else None,
        private_key=key.read_bytes() if key is not None else None,
        certificate_chain=cert.read_bytes() if cert is not None else None,
    )


def _reason(exc: BaseException) -> str:
    """An SSL error in a few words (``CERTIFICATE_VERIFY_FAILED: unable to get local
    issuer certificate``), anything else as its text."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"{exc.reason or 'CERTIFICATE_VERIFY_FAILED'}: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


# -- servers: accepting a connection ------------------------------------------------------


class Wrapped(anyio.abc.ByteStream):
    """A stream over ``stream`` that passes everything through: subclasses change one
    direction (how it receives, or what a send also does)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self.stream.receive(max_bytes)

    async def send(self, item: bytes) -> None:
        await self.stream.send(item)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self.stream.extra_attributes


class _Replay(Wrapped):
    """A stream that gives back the bytes already read from it before reading on (the
    server peeks at a connection's first byte before the TLS handshake reads it)."""

    def __init__(self, stream: anyio.abc.ByteStream, first: bytes) -> None:
        super().__init__(stream)
        self._first = first

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._first:
            data, self._first = self._first[:max_bytes], self._first[max_bytes:]
            return data
        return await self.stream.receive(max_bytes)


def _first_request(data: bytes) -> tuple[int, int]:
    """(request id, version) of the first request among the txmq frames that begin
    ``data`` (else of the first frame; (0, 1) when not even a frame's prefix is there)."""
    found: tuple[int, int] | None = None
    pos = 0
    while len(data) - pos >= PREFIX.size:
        length, version, kind, _code, request_id, _hlen = PREFIX.unpack_from(data, pos)
        if found is None:
            found = (request_id, version or 1)
        if kind & 0x7F == FrameKind.REQUEST:  # (the high bit flags a signed request)
            return request_id, version or 1
        pos += 4 + length
    return found or (0, 1)


async def _refuse_plaintext(
    stream: anyio.abc.ByteStream, first: bytes, peer: str, logger: logging.Logger
) -> None:
    """Answer a plaintext client's request with one error frame, then close."""
    logger.warning("refused a plaintext connection from %s: this server requires TLS", peer)
    request_id, version = _first_request(first)
    frame = encode_frame(
        FrameKind.RESPONSE,
        ResponseCode.BAD_REQUEST,
        request_id,
        ErrorAnswer(error=PLAINTEXT_REFUSED),
        b"",
        version,
    )
    try:
        await stream.send(frame)
        await stream.send_eof()
        # read what else it sends until it closes: closing with unread bytes would reset
        # the connection, and a reset may lose the answer on its way
        with anyio.move_on_after(_DRAIN_S):
            drained = 0
            while drained < _DRAIN_BYTES:
                drained += len(await stream.receive())
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass


async def accept_tls(
    stream: anyio.abc.ByteStream,
    ctx: ssl.SSLContext,
    *,
    peer: str,
    timeout: float,
    logger: logging.Logger = log,
) -> TLSStream | None:
    """The TLS stream of an accepted connection once its handshake is done (within
    ``timeout`` seconds); None when the handshake failed or the client spoke plaintext
    (answered with one error frame naming TLS): the connection is then closed and one line
    logged, never a traceback."""
    try:
        with anyio.fail_after(timeout):
            first = await stream.receive()
            if first[0] != TLS_HANDSHAKE:
                await _refuse_plaintext(stream, first, peer, logger)
            else:
                return await TLSStream.wrap(
                    _Replay(stream, first),
                    server_side=True,
                    ssl_context=ctx,
                    standard_compatible=False,
                )
    except TimeoutError:
        logger.info("closed %s: no TLS handshake within %g s", peer, timeout)
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
        logger.info(
            "connection from %s closed during the TLS handshake (does the client trust this "
            "server's certificate?)",
            peer,
        )
    except ssl.SSLError as exc:
        logger.warning("TLS handshake with %s failed: %s; connection closed", peer, _reason(exc))
    except OSError as exc:
        logger.info("connection from %s failed during the TLS handshake: %s", peer, _reason(exc))
    await anyio.aclose_forcefully(stream)
    return None


@dataclass(frozen=True)
class TlsPeer:
    """The client of a server's TLS connection: the subject common name (CN) of the
    certificate it showed and the server verified (None: none, or the server asks for none,
    or the subject has no single common name)."""

    common_name: str | None = None


def tls_peer(stream: object) -> TlsPeer | None:
    """The client of a server's connection over ``stream`` (None: not TLS)."""
    if not isinstance(stream, TypedAttributeProvider):
        return None
    ssl_object = stream.extra(TLSAttribute.ssl_object, None)
    if ssl_object is None:
        return None
    cert = ssl_object.getpeercert()  # (empty or None unless verified against tls_ca)
    subject: Any = (cert or {}).get("subject", ())
    names = [value for rdn in subject for key, value in rdn if key == "commonName"]
    return TlsPeer(names[0] if len(names) == 1 else None)


# -- clients ------------------------------------------------------------------------------


def _hint(exc: BaseException) -> str:
    text = _reason(exc)
    if any(alert in text for alert in ("CERTIFICATE_REQUIRED", "UNKNOWN_CA", "BAD_CERTIFICATE")):
        return _REFUSED_CLIENT
    if "VERIFY_FAILED" in text:
        return "is tls_ca the authority that signed the server's certificate?"
    return "is TLS on at the server? is tls_ca right?"


_REFUSED_CLIENT = (
    "it refused this client's certificate, or the lack of one: give a certificate signed "
    "by the authority the server trusts, tls_cert and tls_key (TXMQ_TLS_CERT, TXMQ_TLS_KEY)"
)


class _Transport(Wrapped):
    """The TCP stream under a client's TLS stream; :attr:`waiting` (when set) is called
    each time TLS has taken in everything received and asks for more."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        super().__init__(stream)
        self.waiting: Callable[[], None] | None = None

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self.waiting is not None:
            self.waiting()
        return await self.stream.receive(max_bytes)


async def _verdict(tls: TLSStream, transport: _Transport) -> bytes:
    """Under TLS 1.3 a server checks the client's certificate after the client's side of
    the handshake is done: wait (at most :data:`VERDICT_S`) for its session tickets (it
    accepted the client) or its alert (ssl.SSLError: it refused).  What the server sent
    meanwhile (nothing, from a txmq server) is returned to be read first."""
    ssl_object = tls.extra(TLSAttribute.ssl_object)
    received = b""
    with anyio.move_on_after(VERDICT_S) as scope:

        def waiting() -> None:
            session = ssl_object.session
            if session is not None and session.has_ticket:
                scope.cancel()

        transport.waiting = waiting
        try:
            received = await tls.receive()
        finally:
            transport.waiting = None
    return received


class _ClientTls(_Replay):
    """A client's TLS stream: what the server sent before the client asked anything is
    read first, and an SSL error later on is said in one warning line."""

    def __init__(self, stream: TLSStream, address: str, first: bytes = b"") -> None:
        super().__init__(stream, first)
        self.address = address

    async def receive(self, max_bytes: int = 65536) -> bytes:
        try:
            return await super().receive(max_bytes)
        except ssl.SSLError as exc:
            log.warning(
                "TLS connection to %s failed: %s (%s)", self.address, _reason(exc), _hint(exc)
            )
            raise anyio.BrokenResourceError from exc


async def client_handshake(
    stream: anyio.abc.ByteStream, ctx: ssl.SSLContext, host: str, address: str, timeout: float
) -> anyio.abc.ByteStream:
    """``stream`` (connected to ``address``) over TLS, the server checked against ``host``
    and its acceptance of this client awaited; a failed handshake closes the stream and
    raises BrokerUnavailable (nothing sent) saying why."""
    why: BaseException
    hint = ""
    transport = _Transport(stream)
    try:
        with anyio.fail_after(timeout):
            tls = await TLSStream.wrap(
                transport,
                server_side=False,
                hostname=host,
                ssl_context=ctx,
                standard_compatible=False,
            )
            first = b""
            if tls.extra(TLSAttribute.tls_version) == "TLSv1.3":
                # a server that closes now (rather than failing the handshake) refused
                # this client's certificate, or its want of one
                hint = _REFUSED_CLIENT
                first = await _verdict(tls, transport)
        return _ClientTls(tls, address, first)
    except TimeoutError as exc:
        why = exc
        text = f"TLS handshake with {address} did not complete within {timeout:.1f}s"
    except (anyio.EndOfStream, anyio.BrokenResourceError) as exc:
        why = exc
        text = f"TLS handshake with {address} failed: the server closed the connection"
    except (ssl.SSLError, OSError) as exc:
        why = exc
        text = f"TLS handshake with {address} failed: {_reason(exc)}"
    await anyio.aclose_forcefully(stream)
    failed = BrokerUnavailable(f"{text} ({hint or _hint(why)})")
    failed.sent = False
    raise failed from why


# -- test certificates --------------------------------------------------------------------
