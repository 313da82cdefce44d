"""The TLS tests' certificate authorities (made once per test module): ``certs`` signed
the servers' and the client's certificates; ``other`` signed nothing ``certs`` trusts."""

from __future__ import annotations

import pytest

from txmq.security.certs import CertFiles, make_test_ca

__all__ = ["certs", "other"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_test_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """A second authority, which signed nothing the first trusts."""
    return make_test_ca(tmp_path_factory.mktemp("other-ca"), name="another CA")
