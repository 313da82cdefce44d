"""Throw-away certificates for tests and demos: a certificate authority and, signed by it,
a server's and a client's certificate, made with the ``openssl`` command (no Python
package needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from txmq.protocol.settings import SettingsError

__all__ = ["CertFiles", "make_test_ca"]


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


_CA_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
x509_extensions = v3_ca
[dn]
CN = {name}
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""

_LEAF_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = {name}
[leaf]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = {usage}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
{san}"""


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise SettingsError(
            "making test certificates needs the openssl command (apt-get install openssl)"
        )
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SettingsError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


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
    tests and demos: the CA's key sits next to it."""
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
    alt = ", ".join(_san(n) for n in names)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    with tempfile.TemporaryDirectory(prefix="txmq-ca-") as scratch:
        work = Path(scratch)
        (work / "ca.cnf").write_text(_CA_CONFIG.format(name=name))
        _openssl(
            "req", "-x509", *ec, "-config", "ca.cnf", "-days", str(days),
            "-keyout", str(files.ca_key), "-out", str(files.ca), cwd=work,
        )  # fmt: skip
        leaves = (
            ("server", "txmq test server", "serverAuth, clientAuth", files.cert, files.key, alt),
            ("client", "txmq test client", "clientAuth", files.client_cert, files.client_key, ""),
        )
        for stem, cn, usage, cert, key, san in leaves:
            cnf = work / f"{stem}.cnf"
            cnf.write_text(
                _LEAF_CONFIG.format(
                    name=cn, usage=usage, san=f"subjectAltName = {san}\n" if san else ""
                )
            )
            _openssl(
                "req", "-new", *ec, "-config", cnf.name, "-keyout", str(key),
                "-out", f"{stem}.csr", cwd=work,
            )  # fmt: skip
            serial = str(int.from_bytes(os.urandom(8), "big"))
            _openssl(
                "x509", "-req", "-in", f"{stem}.csr", "-CA", str(files.ca),
                "-CAkey", str(files.ca_key), "-set_serial", serial,
                "-days", str(days), "-extfile", cnf.name, "-extensions", "leaf",
                "-out", str(cert), cwd=work,
            )  # fmt: skip
    for key in (files.ca_key, files.key, files.client_key):
        key.chmod(0o600)
    return files


def _san(name: str) -> str:
    import ipaddress

    try:
        ipaddress.ip_address(name)
    except ValueError:
        return f"DNS:{name}"
    return f"IP:{name}"
