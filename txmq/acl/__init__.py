"""Access control (RocketMQ's ACL 2.0 model), the servers' side: users with secret keys
sign their requests (:mod:`txmq.signing`, shared with the clients); per-user rules say what
they may do (:mod:`txmq.acl.policy`, :mod:`txmq.acl.rights`); a server's
:class:`txmq.acl.guard.Guard` checks every request."""

from txmq.acl.policy import ACTIONS, Acl, Resource, Rule, User, parse_resource, topic_resource

__all__ = [
    "ACTIONS",
    "Acl",
    "Resource",
    "Rule",
    "User",
    "parse_resource",
    "topic_resource",
]
