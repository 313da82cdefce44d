"""Operators' tools, as a library (the ``txmq admin`` commands print what they return): the
admin client (:mod:`.client`) and its parts — requests to every broker of a cluster
(:mod:`.fanout`), the cluster's view (:mod:`.cluster`), transactions needing a decision
(:mod:`.transactions`), access control (:mod:`.acl`) and the controller (:mod:`.controller`)."""

from txmq.admin.client import AdminClient, ConsumeTimeout, wait_consumed

__all__ = ["AdminClient", "ConsumeTimeout", "wait_consumed"]
