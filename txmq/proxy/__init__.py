"""RocketMQ 5's proxy in cluster mode (``txmq proxy start``): stateless processes serving
``apache.rocketmq.v2.MessagingService`` to the official RocketMQ 5 clients, forwarding to
the cluster's brokers over txmq's own protocol, with routes from the name servers.  The
proxy itself needs the ``txmq[grpc]`` extra (its settings do not: they are read without
it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from txmq.proxy.config import ProxyConfig

if TYPE_CHECKING:
    from txmq.proxy.server import Proxy

__all__ = ["Proxy", "ProxyConfig"]


def __getattr__(name: str) -> Any:
    if name == "Proxy":  # (imported when used: it needs the txmq[grpc] extra)
        from txmq.proxy.server import Proxy

        return Proxy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
