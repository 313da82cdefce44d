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
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from txmq.settings import SettingsError, load_settings

__all__ = ["ACCESS_KEY_RULE", "ClientSecurity", "Credentials", "client_security"]

#: what an access key (a user name) may be made of
ACCESS_KEY_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


@dataclass(frozen=True)
class Credentials:
    """A user's access key (its name) and secret key (what signs its requests)."""

    access_key: str
    secret_key: str = field(repr=False)

    def __post_init__(self) -> None:
        if not ACCESS_KEY_RULE.fullmatch(self.access_key):
            raise SettingsError(
                f"access key {self.access_key!r} must be 1-64 characters: letters, digits "
                "and _ . @ - (starting with a letter or digit)"
            )
        if len(self.secret_key) < 8:
            raise SettingsError(
                f"the secret key of {self.access_key!r} must be at least 8 characters"
            )

    @cached_property
    def secret(self) -> bytes:
        return self.secret_key.encode()


@dataclass(frozen=True)
class ClientSecurity:
    """A client's credentials and TLS settings (everything off by default)."""

    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    #: connect over TLS (the server's certificate checked against ``tls_ca``, else the
    #: system's certificate authorities)
    tls: bool = False
    #: the certificate authorities that signed the servers' certificates (a PEM file)
    tls_ca: Path | None = None
    #: this client's certificate and key, for servers that ask for one (``--tls-ca``)
    tls_cert: Path | None = None
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
        from txmq.tls import client_context

        return client_context(ca=self.tls_ca, cert=self.tls_cert, key=self.tls_key)


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
