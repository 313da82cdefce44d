"""Access control on the gRPC endpoint: the broker's guard, asked about RocketMQ 5 RPCs.

Under access control every RPC is signed the RocketMQ 5 way (:mod:`txmq.security.acl.grpc_auth`:
UNAUTHORIZED naming why not) and is allowed by the same table as txmq's protocol
(:mod:`txmq.security.acl.rights`), asked about the txmq request the RPC stands for:

- QueryRoute: GetTopicRoute (any right on the topic)
- QueryAssignment, ReceiveMessage, AckMessage, ChangeInvisibleDuration: PullMessage of
  the group and topic (``sub`` on both)
- ForwardMessageToDeadLetterQueue: ConsumerSendMsgBack (``sub`` on the group)
- SendMessage: each message as a SendMessage (``pub`` on its topic); a refused message's
  entry answers FORBIDDEN, the others are stored.  A half keeps its sender's name.
- EndTransaction: the transaction service's own check (the user that sent the half, with
  ``pub`` on its topic), the same as for txmq's protocol
- Telemetry: authenticated once, when the stream opens; the session carries its user
  (``acl_user``), so a check-back reaches only producers of the half's sender; a
  consumer's settings need ``sub`` on its group and topics
- Heartbeat, NotifyClientTermination: any user, but only for a client (client id) of its
  own: one user cannot end or take over another's session
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from txmq.protocol.wire import PullMessage
from txmq.protocol.wire.base import Request
from txmq.security.acl.grpc_auth import GrpcPeer, authenticate, grpc_peer
from txmq.security.acl.policy import Resource
from txmq.server.grpc.telemetry import Session, Sessions

if TYPE_CHECKING:
    from txmq.security.acl.guard import Guard
    from txmq.security.acl.policy import User

__all__ = ["Access", "pull"]


def pull(group: str, topic: str) -> PullMessage:
    """The txmq request a RocketMQ 5 consumer's RPC stands for (what it needs allowed)."""
    return PullMessage(topic=topic, queue_id=0, offset=0, group=group)


class Access:
    """The checks the endpoint's RPCs make (all of them pass with no guard)."""

    def __init__(self, guard: Guard | None, sessions: Sessions) -> None:
        self.guard = guard
        self.sessions = sessions

    def caller(self, context: Any, rpc: str) -> tuple[User | None, GrpcPeer]:
        """Who makes this call (None: no access control) and from where, or
        AuthenticationFailed."""
        peer = grpc_peer(str(context.peer()))
        if self.guard is None:
            return None, peer
        metadata = context.invocation_metadata()
        return authenticate(self.guard, metadata, peer, f"{rpc} (gRPC)"), peer

    def authorize(self, user: User | None, request: Request[Any], peer: GrpcPeer, rpc: str) -> None:
        """NoPermission unless ``user`` may make the txmq ``request`` this RPC stands for."""
        if self.guard is not None and user is not None:
            self.guard.authorize(user, request, peer, f"{rpc} (gRPC)")

    def session(self, user: User | None, peer: GrpcPeer, cid: str, rpc: str) -> Session | None:
        """The session of client ``cid``; NoPermission if another user opened it."""
        session = self.sessions.get(cid)
        if session is None or self.guard is None or user is None or user.super_user:
            return session
        owner = session.attributes.get("acl_user")
        if owner is not None and owner != user.name:
            self.guard.refuse(
                peer,
                f"{rpc} (gRPC): client {cid!r} is a client of user {owner!r}, not {user.name!r}",
            )
        return session

    def may_subscribe(self, user: User, peer: GrpcPeer, subscription: Any) -> None:
        """NoPermission unless ``user`` may consume as a consumer's settings say (its group
        and each topic it subscribes)."""
        group = subscription.group.name
        topics = sorted({e.topic.name for e in subscription.subscriptions if e.topic.name})
        for topic in topics:
            self.authorize(user, pull(group, topic), peer, "Telemetry settings")
        if not topics and self.guard is not None:
            what = "Telemetry settings (gRPC)"
            self.guard.require(user, "sub", Resource("group", group), what, peer)
