"""Proxy settings: a frozen dataclass read from TOML ``[proxy]`` and ``TXMQ_PROXY_*``
environment variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from txmq.protocol.peer import parse_address, parse_namesrv
from txmq.protocol.settings import (
    DEFAULT_DELAY_LEVELS,
    SettingsError,
    load_settings,
    parse_delay_levels,
)
from txmq.protocol.wire import DEFAULT_MAX_FRAME_SIZE
from txmq.security.client import ClientSecurity
from txmq.security.tls import ServerTls

__all__ = ["ProxyConfig"]


@dataclass(frozen=True)
class ProxyConfig:
    """A gRPC proxy (``txmq proxy start``): ``[proxy]`` in TOML, ``TXMQ_PROXY_*`` in the
    environment."""

    #: the name servers whose brokers the proxy serves, "h1:9876;h2:9876" (required)
    #: (RocketMQ's `namesrvAddr`)
    namesrv: str = ""
    #: the address the proxy listens on (127.0.0.1: this machine only)
    host: str = "127.0.0.1"
    #: RocketMQ 5's gRPC protocol (what the official clients speak) on this port (0: any
    #: free port) (RocketMQ's `grpcServerPort`)
    grpc_port: int = 8081
    #: the address clients are told when they name none themselves (default:
    #: host:grpc port); clients given a list of proxies are answered with that list
    advertised_address: str = ""
    #: the largest message body a client may send (the brokers' max_message_size)
    max_message_size: int = 4 * 1024 * 1024
    #: the largest gRPC message the proxy takes or sends
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    #: the brokers' delay levels ("1s 5s ... 2h"): consumers are told to wait levels 3 and
    #: on between attempts, as a broker's own endpoint tells them (give the brokers'
    #: message_delay_levels) (RocketMQ's `messageDelayLevel`)
    message_delay_levels: str = DEFAULT_DELAY_LEVELS
    #: how long a topic's route is reused before the name servers are asked again (also
    #: asked again after a failed request)
    route_ttl_s: float = 30.0
    #: how long a request to a broker may take (a receive's long polling comes on top)
    request_timeout_s: float = 3.0
    #: sends (and acks) to a broker set while one of its requests is out wait up to this
    #: long for others to go with them in one request (0: each goes at the end of its
    #: event-loop turn, with those of the same turn); a send to a set with nothing out goes
    #: at once.  Fewer, bigger requests cost the brokers less CPU per message
    batch_linger_ms: float = 2.0
    #: how often the proxy heartbeats every broker set's master as a producer of the
    #: groups its clients publish (so that check-backs reach them) (RocketMQ's
    #: `heartbeatBrokerInterval`)
    heartbeat_interval_s: float = 10.0
    #: TLS on the gRPC port: its certificate (a PEM file; with tls_key); the proxy then
    #: reaches the brokers and name servers over TLS too (RocketMQ's `tls.server.certPath`)
    tls_cert: Path | None = None
    #: the private key of tls_cert (a PEM file) (RocketMQ's `tls.server.keyPath`)
    tls_key: Path | None = None
    #: with TLS on, require client certificates signed by this authority (a PEM file), and
    #: check the brokers' certificates against it (RocketMQ's `tls.server.trustCertPath`)
    tls_ca: Path | None = None
    #: the proxy's own access key, for brokers and name servers under access control: what
    #: signs its requests (a user of their ACL files, allowed to publish and consume what
    #: its clients do)
    access_key: str = ""
    #: the secret key that goes with access_key ($TXMQ_PROXY_SECRET_KEY or [proxy] of the
    #: TOML file; never the command line)
    secret_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, Path(value) if value else None)
        _ = self.namesrv_addresses  # a bad list fails at start (an empty one when served)
        if not 0 <= self.grpc_port <= 65535:
            raise SettingsError(f"grpc_port {self.grpc_port} is not between 0 and 65535")
        if self.advertised_address:
            try:
                parse_address(self.advertised_address)
            except ValueError as exc:
                raise SettingsError(f"advertised_address: {exc}") from None
        if self.max_message_size <= 0 or self.max_message_size + 65536 > self.max_frame_size:
            raise SettingsError(
                "max_message_size must be positive and at least 64 KiB below max_frame_size"
            )
        _ = self.retry_delays_ms
        for name in ("route_ttl_s", "request_timeout_s", "heartbeat_interval_s"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be positive")
        if not 0 <= self.batch_linger_ms <= 1000:
            raise SettingsError("batch_linger_ms must be between 0 and 1000")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError("tls_cert and tls_key go together: set both (or neither)")
        if self.tls_ca is not None and self.tls_cert is None:
            raise SettingsError("tls_ca needs TLS on: set tls_cert and tls_key")
        if bool(self.access_key) != bool(self.secret_key):
            raise SettingsError(
                "access_key and secret_key go together (TXMQ_PROXY_ACCESS_KEY and "
                "TXMQ_PROXY_SECRET_KEY): set both or neither"
            )
        _ = self.peer_security()  # a bad key fails at start

    @cached_property
    def namesrv_addresses(self) -> tuple[str, ...]:
        try:
            return parse_namesrv(self.namesrv)
        except ValueError as exc:
            raise SettingsError(str(exc)) from None

    @cached_property
    def retry_delays_ms(self) -> tuple[int, ...]:
        """What consumers wait between attempts: the delay levels from level 3 on."""
        return parse_delay_levels(self.message_delay_levels)[2:] or (1000,)

    def server_tls(self) -> ServerTls | None:
        """TLS on the gRPC port (None: plaintext)."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return ServerTls(self.tls_cert, self.tls_key, self.tls_ca)

    def peer_security(self) -> ClientSecurity:
        """How the proxy reaches brokers and name servers: signed with its access key (if
        any), over TLS when its own port is (as a broker reaches its peers)."""
        return self._peer_security

    @cached_property
    def _peer_security(self) -> ClientSecurity:
        ak, sk = self.access_key or None, self.secret_key or None
        if self.tls_cert is None:
            return ClientSecurity(access_key=ak, secret_key=sk)
        return ClientSecurity(
            access_key=ak,
            secret_key=sk,
            tls=True,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
        )

    @classmethod
    def load(
        cls,
        file: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> ProxyConfig:
        return load_settings(
            cls,
            file=file,
            section="proxy",
            env_prefix="TXMQ_PROXY_",
            env=env,
            overrides=overrides,
        )
