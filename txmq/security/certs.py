"""Throw-away certificates for tests and demos: a certificate authority and, signed by it,
a server's and a client's certificate, made in-process with the ``cryptography`` package."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertFiles", "make_client_cert", "make_test_ca"]


@dataclass(frozen=True)
class CertFiles:
    """A certificate authority and a server's and a client's certificates signed by it
    (PEM files; the keys unencrypted)."""

    ca: Path
    ca_key: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


#: a certificate is valid from this long before it is made (a peer whose clock is a little
#: behind takes it too)
_BACKDATE = datetime.timedelta(minutes=5)


def make_test_ca(
    folder: Path | str,
    *,
    names: Sequence[str] = ("127.0.0.1", "localhost"),
    days: int = 365,
    name: str = "txmq test CA",
) -> CertFiles:
    """A new certificate authority in ``folder`` and, signed by it, a server certificate
    for ``names`` (IP addresses and DNS names; its extended key usage allows it as a client
    certificate too, as a broker shows it to name servers) and a client certificate.  For
    tests and demos: the CA's key sits next to it.  Keys are P-256 (unencrypted PKCS#8,
    readable by their owner only), signatures SHA-256."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    files = CertFiles(
        ca=out / "ca.pem",
        ca_key=out / "ca.key",
        cert=out / "server.pem",
        key=out / "server.key",
        client_cert=out / "client.pem",
        client_key=out / "client.key",
    )
    now = datetime.datetime.now(datetime.UTC)
    authority = _Authority(
        name=_name(name),
        key=ec.generate_private_key(ec.SECP256R1()),
        start=now - _BACKDATE,
        end=now + datetime.timedelta(days=days),
    )
    authority.issue(
        authority.name,
        authority.key,
        [x509.BasicConstraints(ca=True, path_length=None), _key_usage(authority=True)],
        files.ca,
        files.ca_key,
    )
    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    authority.issue(
        _name("txmq test server"),
        ec.generate_private_key(ec.SECP256R1()),
        [*_leaf([server, client]), x509.SubjectAlternativeName([_san(n) for n in names])],
        files.cert,
        files.key,
    )
    authority.issue(
        _name("txmq test client"),
        ec.generate_private_key(ec.SECP256R1()),
        _leaf([client]),
        files.client_cert,
        files.client_key,
    )
    return files


def make_client_cert(
    ca: CertFiles, folder: Path | str, common_name: str, *, days: int = 365
) -> tuple[Path, Path]:
    """A client certificate whose subject common name is ``common_name`` (under access
    control over mutual TLS: the user of that name), signed by ``ca``'s authority: the
    certificate and key files (``folder/<common_name>.pem`` and ``.key``)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    issuer = x509.load_pem_x509_certificate(ca.ca.read_bytes())
    key = serialization.load_pem_private_key(ca.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):  # pragma: no cover - made above
        raise TypeError(f"{ca.ca_key} is not the EC key make_test_ca makes")
    now = datetime.datetime.now(datetime.UTC)
    authority = _Authority(
        name=issuer.subject,
        key=key,
        start=now - _BACKDATE,
        end=min(now + datetime.timedelta(days=days), issuer.not_valid_after_utc),
    )
    cert, cert_key = out / f"{common_name}.pem", out / f"{common_name}.key"
    authority.issue(
        _name(common_name),
        ec.generate_private_key(ec.SECP256R1()),
        _leaf([ExtendedKeyUsageOID.CLIENT_AUTH]),
        cert,
        cert_key,
    )
    return cert, cert_key


@dataclass(frozen=True)
class _Authority:
    """What signs: the CA's name and key, and the validity it gives every certificate."""

    name: x509.Name
    key: ec.EllipticCurvePrivateKey
    start: datetime.datetime
    end: datetime.datetime

    def issue(
        self,
        subject: x509.Name,
        key: ec.EllipticCurvePrivateKey,
        extensions: Sequence[x509.ExtensionType],
        cert_path: Path,
        key_path: Path,
    ) -> None:
        """A certificate for ``key`` (which goes to ``key_path``) written to ``cert_path``;
        basic constraints and key usage are marked critical, as RFC 5280 asks of a CA's."""
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.start)
            .not_valid_after(self.end)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
        )
        for ext in extensions:
            critical = isinstance(ext, x509.BasicConstraints | x509.KeyUsage)
            builder = builder.add_extension(ext, critical)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _leaf(usage: list[x509.ObjectIdentifier]) -> list[x509.ExtensionType]:
    return [
        x509.BasicConstraints(ca=False, path_length=None),
        _key_usage(authority=False),
        x509.ExtendedKeyUsage(usage),
    ]


def _key_usage(*, authority: bool) -> x509.KeyUsage:
    """An authority signs certificates and revocation lists; a leaf signs handshakes."""
    return x509.KeyUsage(
        digital_signature=not authority,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=authority,
        crl_sign=authority,
        encipher_only=False,
        decipher_only=False,
    )


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """An unencrypted PKCS#8 PEM key, readable by its owner only from the start."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # a key file that was there keeps its mode otherwise
        f.write(pem)
