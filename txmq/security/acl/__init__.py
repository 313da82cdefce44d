"""Access control (RocketMQ's ACL 2.0 model), the servers' side: users with secret keys
sign their requests (:mod:`txmq.security.signing`, shared with the clients); per-user rules say what
they may do (:mod:`txmq.security.acl.policy`, :mod:`txmq.security.acl.rights`); a server's
:class:`txmq.security.acl.guard.Guard` checks every request."""

from txmq.security.acl.policy import (
    ACTIONS,
    Acl,
    Resource,
    Rule,
    User,
    parse_resource,
    topic_resource,
)

__all__ = [
    "ACTIONS",
    "Acl",
    "Resource",
    "Rule",
    "User",
    "parse_resource",
    "topic_resource",
]
