"""Security, shared by clients and servers: credentials (:mod:`.credentials`), request
signing (:mod:`.signing`), TLS (:mod:`.tls`), test certificates (:mod:`.certs`), what a
client needs to reach a secured endpoint (:mod:`.client`) and access control — RocketMQ's
ACL 2.0 model: policies, rights and the guard servers check requests with (:mod:`.acl`)."""

from txmq.security.client import ClientSecurity, client_security
from txmq.security.credentials import Credentials

__all__ = ["ClientSecurity", "Credentials", "client_security"]
