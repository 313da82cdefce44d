"""The channel under :class:`txmq.transports.grpc.remote.GrpcRemote`: one gRPC channel to a
RocketMQ 5 endpoint, the request metadata RocketMQ's proxies expect, unary calls with gRPC failures
as txmq's errors, and the client's Telemetry stream (its settings first, then the
endpoint's commands: check-backs go to :meth:`Channel._check_back`)."""

from __future__ import annotations

import logging
import platform
import socket
import uuid
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.abc
import grpc
import grpc.aio
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from txmq.protocol.grpc_convert import duration, error_of
from txmq.protocol.peer import parse_address
from txmq.protocol.wire.errors import (
    BrokerUnavailable,
    RequestTimeout,
    ServerError,
    TxmqError,
    UnsupportedRequest,
)
from txmq.security.client import ClientSecurity
from txmq.security.signing import signed_metadata
from txmq.security.tls import grpc_channel_credentials
from txmq.transports.port import ClientSide

__all__ = ["Channel", "rpc_error", "settle"]

log = logging.getLogger("txmq.grpc")

#: seconds between attempts to reopen a broken Telemetry stream
REOPEN_DELAY_S = 1.0
#: how long closing a channel waits for its cancelled calls to finish
CLOSE_GRACE_S = 2.0


def _version() -> str:
    """The client's version as RocketMQ 5's endpoint is told it (txmq's, installed)."""
    from txmq.protocol.version import installed_version

    return f"txmq-{installed_version()}"


def rpc_error(exc: grpc.aio.AioRpcError, what: str, address: str) -> TxmqError:
    code = exc.code()
    text = f"{what} to gRPC endpoint {address}: {code.name} {exc.details() or ''}".strip()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeout(text)
    if code == grpc.StatusCode.UNAVAILABLE:
        return BrokerUnavailable(text)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return UnsupportedRequest(text)
    return ServerError(text)


async def settle(call: Any) -> None:
    """Cancel ``call`` (if it is still open) and wait, shielded and at most
    :data:`CLOSE_GRACE_S`, until grpc has confirmed it on this event loop: grpc delivers a
    cancellation's completion later, on the loop that made the call, and one that arrives
    after that loop closed fails in grpc's poller (inside whatever loop runs next)."""
    call.cancel()
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_GRACE_S):
        try:
            await call.code()
        except Exception:  # only waiting for it to end
            pass


class Channel:
    """One RocketMQ 5 gRPC endpoint (``host:port``), reached over one channel."""

    def __init__(
        self,
        address: str,
        side: ClientSide,
        *,
        connect_timeout: float = 3.0,
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.side = side
        self.connect_timeout = connect_timeout
        #: over TLS when it says so (its tls_ca, tls_cert and tls_key)
        self.security = security
        #: the endpoint's answer to our settings (its retry back-off policy, ...)
        self.settings: Any = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._lock = anyio.Lock()
        self._write_lock = anyio.Lock()
        self._stream: Any = None
        self._stream_scope: anyio.CancelScope | None = None
        self._stream_up = anyio.Event()
        self._sent_settings: bytes = b""
        self._topics: dict[str, None] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg

    def detach(self) -> None:
        if self._stream_scope is not None:
            self._stream_scope.cancel()
        if self._stream is not None:
            self._stream.cancel()
        self._tg = None

    async def aclose(self) -> None:
        """Close the channel (after :meth:`detach`), once the calls cancelled by then have
        finished (grpc confirms a cancellation later, on the event loop: a loop closed
        before that fails in grpc's poller), waiting at most :data:`CLOSE_GRACE_S`."""
        channel, self._channel = self._channel, None
        if channel is not None:
            with anyio.CancelScope(shield=True):
                await channel.close(grace=CLOSE_GRACE_S)

    async def connection(self) -> Channel:
        """Open the channel and the Telemetry stream (the settings sent) if not open."""
        if self._tg is None:
            raise BrokerUnavailable("client is not started")
        async with self._lock:
            if self._channel is None:
                channel = self._open()
                try:
                    with anyio.fail_after(self.connect_timeout):
                        await channel.channel_ready()
                except TimeoutError:
                    await channel.close()
                    tls = self.security is not None and self.security.uses_tls
                    unreachable = BrokerUnavailable(
                        f"cannot connect to gRPC endpoint {self.address} within "
                        f"{self.connect_timeout:.1f}s"
                        + (" over TLS (is TLS on at the endpoint? is tls_ca right?)" if tls else "")
                    )
                    unreachable.sent = False
                    raise unreachable from None
                self._channel = channel
                self._stub = spb_grpc.MessagingServiceStub(channel)
            if self._stream_scope is None:
                self._stream_scope = anyio.CancelScope()
                self._tg.start_soon(self._telemetry_loop, self._stream_scope)
        with anyio.move_on_after(self.connect_timeout):
            await self._stream_up.wait()
        return self

    def _open(self) -> grpc.aio.Channel:
        security = self.security
        if security is None or not security.uses_tls:
            return grpc.aio.insecure_channel(self.address)
        credentials = grpc_channel_credentials(security.tls_ca, security.tls_cert, security.tls_key)
        return grpc.aio.secure_channel(self.address, credentials)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """A call's metadata, signed the RocketMQ 5 way when the client has credentials
        (:mod:`txmq.security.acl.grpc_auth`: fresh for every call and every Telemetry stream)."""
        credentials = self.security.credentials if self.security is not None else None
        signed: tuple[tuple[str, str], ...]
        if credentials is not None:
            signed = signed_metadata(credentials)
        else:
            signed = (("x-mq-date-time", datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")),)
        return (
            ("x-mq-client-id", self.side.client_id()),
            ("x-mq-language", "PYTHON"),
            ("x-mq-protocol", "GRPC_V2"),
            ("x-mq-client-version", _version()),
            ("x-mq-namespace", ""),
            *signed,
            ("x-mq-request-id", str(uuid.uuid4())),
        )

    async def _unary(
        self, name: str, request: Any, timeout: float, extra: tuple[tuple[str, Any], ...] = ()
    ) -> Any:
        """Call unary RPC ``name`` (``extra``: metadata beside the client's own)."""
        await self.connection()
        metadata = self._metadata() + extra
        call = getattr(self._stub, name)(request, metadata=metadata, timeout=timeout)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, name, self.address) from None
        except BaseException:  # cancelled: let grpc confirm it on this loop first
            await settle(call)
            raise

    # -- clients: heartbeats and the Telemetry stream ----------------------------------------

    def _settings(self) -> Any:
        heartbeat = self.side.heartbeat()
        settings = pb.Settings(
            access_point=pb.Endpoints(addresses=[pb.Address(host=self.host, port=self.port)]),
            request_timeout=duration(int(self.connect_timeout * 1000)),
            user_agent=pb.UA(
                language=pb.PYTHON,
                version=_version(),
                platform=platform.platform(),
                hostname=socket.gethostname(),
            ),
        )
        if heartbeat is not None and heartbeat.consumers:
            consumer = heartbeat.consumers[0]
            settings.client_type = pb.SIMPLE_CONSUMER
            settings.subscription.group.name = consumer.group
            for topic, expression in consumer.subscriptions.items():
                if topic.startswith("%RETRY%"):
                    continue  # RocketMQ 5 endpoints keep retries out of sight
                settings.subscription.subscriptions.append(
                    pb.SubscriptionEntry(
                        topic=pb.Resource(name=topic),
                        expression=pb.FilterExpression(type=pb.TAG, expression=expression),
                    )
                )
        else:
            settings.client_type = pb.PRODUCER
            for topic in dict.fromkeys([*self.side.topics(), *self._topics]):
                settings.publishing.topics.append(pb.Resource(name=topic))
        return settings

    async def _send_settings(self, *, force: bool = False) -> None:
        stream = self._stream
        if stream is None:
            return  # the stream sends them when it opens
        settings = self._settings()
        data = settings.SerializeToString(deterministic=True)
        if data == self._sent_settings and not force:
            return
        async with self._write_lock:
            try:
                await stream.write(spb.TelemetryCommand(settings=settings))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
                log.debug("settings to %s not written: %s", self.address, exc)
                return
        self._sent_settings = data

    async def _telemetry_loop(self, scope: anyio.CancelScope) -> None:
        with scope:
            while True:
                await self._telemetry_once()
                await anyio.sleep(REOPEN_DELAY_S)

    async def _telemetry_once(self) -> None:
        stream = self._stub.Telemetry(metadata=self._metadata())
        self._stream = stream
        try:
            await self._send_settings(force=True)
            while True:
                command = await stream.read()
                if command is grpc.aio.EOF:
                    log.info("the Telemetry stream of %s ended; reopening", self.address)
                    return
                await self._on_command(command)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.warning(
                    "the Telemetry stream of %s broke (%s); reopening",
                    self.address,
                    exc.code().name,
                )
        finally:
            self._stream = None
            self._sent_settings = b""
            await settle(stream)

    async def _on_command(self, command: Any) -> None:
        if command.HasField("status") and command.status.code not in (pb.OK, 0):
            log.warning("gRPC endpoint %s: %s", self.address, error_of(command.status, "telemetry"))
        kind = command.WhichOneof("command")
        if kind == "settings":
            self.settings = command.settings
            self._stream_up.set()
        elif kind == "recover_orphaned_transaction_command":
            try:
                self._check_back(command.recover_orphaned_transaction_command)
            except Exception:
                log.exception("a check-back from %s could not be handled", self.address)
        elif kind == "print_thread_stack_trace_command":
            reply = spb.TelemetryCommand(
                thread_stack_trace=spb.ThreadStackTrace(
                    nonce=command.print_thread_stack_trace_command.nonce, thread_stack_trace=""
                )
            )
            await self._write(reply)
        elif kind == "verify_message_command":
            reply = spb.TelemetryCommand(
                status=pb.Status(code=pb.NOT_IMPLEMENTED, message="txmq does not verify"),
                verify_message_result=spb.VerifyMessageResult(
                    nonce=command.verify_message_command.nonce
                ),
            )
            await self._write(reply)

    async def _write(self, command: Any) -> None:
        stream = self._stream
        if stream is None:
            return
        async with self._write_lock:
            try:
                await stream.write(command)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
                log.debug("telemetry write to %s failed: %s", self.address, exc)

    def _check_back(self, command: Any) -> None:
        """A RecoverOrphanedTransactionCommand (the remote turns it into txmq's check-back)."""
        raise NotImplementedError
