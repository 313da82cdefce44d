"""The demo's ``--secure`` mode: access control and TLS on every port.

A certificate authority made for the run signs the servers' certificate and a client
certificate; the name server and every broker run with ``--tls-cert/--tls-key`` and
``--tls-ca`` (mutual TLS: clients show the client certificate) and ``--acl`` (an ACL file
with a user per service, each allowed only what it does).  Each process gets its
credentials and TLS settings from its environment (``TXMQ_ACCESS_KEY``, ``TXMQ_TLS_CA``,
...), as a deployment would: nothing secret on a command line.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from txmq.security.acl import Acl, Rule
from txmq.security.certs import CertFiles, make_test_ca

__all__ = ["NODE", "OPERATOR", "Secure", "make_secure"]

#: the brokers' own user (registering, replicating, heartbeating to the controller)
NODE = "txmq-node"
#: the demo's own clients: topics, checks, injected faults
OPERATOR = "demo-operator"


def _rules(user: str, topics: dict[str, str]) -> list[Rule]:
    return [
        Rule.parse({"resource": resource, "actions": actions.split()}, user)
        for resource, actions in topics.items()
    ]


#: what each service may do (and nothing else); a saga's commands go to saga-<service>, its
#: answers (and the deadlines the coordinator sends itself) to saga-orders-replies
RULES = {
    # the coordinator: commands to every participant (itself included, for its review),
    # answers and deadlines to itself; consumes its answers and its own commands
    "order-service": {
        "topic:saga-inventory": "pub",
        "topic:saga-payment": "pub",
        "topic:saga-orders": "pub sub",
        "topic:saga-orders-replies": "pub sub",
        "group:saga-orders-coordinator": "sub",
        "group:saga-orders": "sub",
    },
    # participants: consume their commands, answer the coordinator
    "inventory-service": {
        "topic:saga-inventory": "sub",
        "group:saga-inventory": "sub",
        "topic:saga-orders-replies": "pub",
    },
    "payment-service": {
        "topic:saga-payment": "sub",
        "group:saga-payment": "sub",
        "topic:saga-orders-replies": "pub",
    },
}


@dataclass
class Secure:
    certs: CertFiles
    acl: Path
    secrets: dict[str, str] = field(repr=False)

    def server_args(self) -> list[str]:
        """A name server's or a broker's options."""
        c = self.certs
        return [
            *("--acl", str(self.acl)),
            *("--tls-cert", str(c.cert), "--tls-key", str(c.key), "--tls-ca", str(c.ca)),
        ]

    def client_env(self, user: str) -> dict[str, str]:
        """A client process's environment: ``user``'s credentials, TLS with the client
        certificate."""
        c = self.certs
        return {
            "TXMQ_ACCESS_KEY": user,
            "TXMQ_SECRET_KEY": self.secrets[user],
            "TXMQ_TLS": "1",
            "TXMQ_TLS_CA": str(c.ca),
            "TXMQ_TLS_CERT": str(c.client_cert),
            "TXMQ_TLS_KEY": str(c.client_key),
        }

    def broker_env(self) -> dict[str, str]:
        """A broker's own credentials (it shows its server certificate to its peers)."""
        return {
            "TXMQ_BROKER_ACCESS_KEY": NODE,
            "TXMQ_BROKER_SECRET_KEY": self.secrets[NODE],
        }

    @property
    def summary(self) -> str:
        users = ", ".join(sorted(self.secrets))
        return f"ACL on every port ({self.acl}: users {users}) and mutual TLS (CA {self.certs.ca})"


def make_secure(folder: Path) -> Secure:
    """A CA, certificates and an ACL file in ``folder``."""
    certs = make_test_ca(folder / "tls")
    keys = {name: secrets.token_urlsafe(18) for name in (NODE, OPERATOR, *RULES)}
    acl = Acl()
    for name, key in keys.items():
        acl = acl.with_user(name, key, super_user=name in (NODE, OPERATOR))
    for name, topics in RULES.items():
        for rule in _rules(name, topics):
            acl = acl.with_rule(name, rule)
    path = folder / "acl.toml"
    acl.save(path)
    return Secure(certs, path, keys)
