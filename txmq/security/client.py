"""What a client needs to reach a secured endpoint: its credentials (an access key and a
secret key, RocketMQ's ACL) and TLS.

Read, lowest precedence first, from the TOML file's ``[client]`` section (the file named by
``config=`` or ``$TXMQ_CONFIG``), the environment (``TXMQ_ACCESS_KEY``, ``TXMQ_SECRET_KEY``,
``TXMQ_TLS``, ``TXMQ_TLS_CA``, ``TXMQ_TLS_CERT``, ``TXMQ_TLS_KEY``) and the client's
constructor arguments.  Never from a command line that ``ps`` shows: the CLI reads the same
environment and file.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import anyio.abc

from txmq.protocol.settings import SettingsError, load_settings
from txmq.security.credentials import Credentials
from txmq.security.signing import Signer
from txmq.security.tls import client_context, client_handshake

__all__ = ["ClientSecurity", "client_security"]


@dataclass(frozen=True)
class ClientSecurity:
    """A client's credentials and TLS settings (everything off by default)."""

    #: the access key that signs every request (a user of the servers' ACL files; with
    #: secret_key, or neither: requests unsigned) (RocketMQ's `accessKey`)
    access_key: str | None = None
    #: the secret key of access_key; never a command-line flag (RocketMQ's `secretKey`)
    secret_key: str | None = field(default=None, repr=False)
    #: connect over TLS (the server's certificate checked against ``tls_ca``, else the
    #: system's certificate authorities) (RocketMQ's `useTLS`)
    tls: bool = False
    #: the certificate authorities that signed the servers' certificates (a PEM file)
    #: (RocketMQ's `tls.client.trustCertPath`)
    tls_ca: Path | None = None
    #: this client's certificate, for servers that ask for one (``--tls-ca``; with
    #: tls_key) (RocketMQ's `tls.client.certPath`)
    tls_cert: Path | None = None
    #: the private key of tls_cert (RocketMQ's `tls.client.keyPath`)
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if bool(self.access_key) != bool(self.secret_key):
            have, missing = (
                ("access key", "secret key") if self.access_key else ("secret key", "access key")
            )
            raise SettingsError(
                f"a {have} without a {missing}: set both (TXMQ_ACCESS_KEY and "
                "TXMQ_SECRET_KEY) or neither"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingsError("tls_cert and tls_key go together: set both or neither")
        self.credentials  # noqa: B018 - checked now, not at the first request

    @cached_property
    def credentials(self) -> Credentials | None:
        if not self.access_key or not self.secret_key:
            return None
        return Credentials(self.access_key, self.secret_key)

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.tls_cert is not None

    @cached_property
    def ssl_context(self) -> ssl.SSLContext | None:
        """The client side's TLS context (None: plaintext)."""
        if not self.uses_tls:
            return None
        return client_context(ca=self.tls_ca, cert=self.tls_cert, key=self.tls_key)

    # -- what a connection asks of it (txmq.protocol.connection.Secures) --------------------

    async def secure(
        self, stream: anyio.abc.ByteStream, host: str, address: str, timeout: float
    ) -> anyio.abc.ByteStream:
        """``stream`` over TLS when this client uses TLS (else as it is); a failed handshake
        raises BrokerUnavailable (nothing sent) saying why."""
        ctx = self.ssl_context
        if ctx is None:
            return stream
        return await client_handshake(stream, ctx, host, address, timeout)

    def signer(self) -> Signer | None:
        """A new signer for one connection's requests (None: they go unsigned); over TLS
        it stops signing once the server says the connection is authenticated."""
        credentials = self.credentials
        if credentials is None:
            return None
        return Signer(credentials, stateful=self.uses_tls)


def client_security(
    security: ClientSecurity | None = None,
    *,
    config: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ClientSecurity:
    """``security`` as given, else the settings from the TOML file's ``[client]`` section
    (``config`` or ``$TXMQ_CONFIG``), ``TXMQ_*`` variables and ``overrides`` (constructor
    arguments; None leaves a setting as the file and environment say)."""
    if security is not None:
        return security
    environ = os.environ if env is None else env
    file = config or environ.get("TXMQ_CONFIG") or None
    return load_settings(
        ClientSecurity,
        file=file,
        section="client",
        env_prefix="TXMQ_",
        env=environ,
        overrides=overrides,
    )
