"""The proxy process: RocketMQ 5's gRPC endpoint (:mod:`txmq.server.grpc`, the same as a
broker's) over a :class:`~txmq.server.grpc.ports.BrokerCore` that forwards to the cluster's
brokers over txmq's protocol (:mod:`txmq.proxy.cluster`, :mod:`txmq.proxy.pops`).

Proxies are stateless: any number of them serve the same cluster, and a client given
several (``"p1:8081;p2:8081"``) is answered routes naming that list, so it goes on through
another when one dies.  Run it with ``txmq proxy start`` or embed it:
``async with Proxy(config) as proxy``.
"""

from __future__ import annotations

import ipaddress
import logging

import anyio
import anyio.abc

from txmq.protocol.settings import SettingsError
from txmq.proxy.cluster import ClusterLink
from txmq.proxy.config import ProxyConfig
from txmq.proxy.pops import ProxyPops
from txmq.server.grpc import BrokerCore, GrpcEndpoint, QueueSet
from txmq.server.serving import Stoppable

__all__ = ["Proxy"]

log = logging.getLogger("txmq.proxy")


class Proxy(Stoppable):
    """A gRPC proxy.  ``await proxy.serve()`` runs it until :meth:`request_stop`."""

    what = "proxy"

    def __init__(self, config: ProxyConfig) -> None:
        if not config.namesrv_addresses:
            raise SettingsError(
                "the proxy needs the name servers of its brokers: --namesrv 'h1:9876;h2:9876' "
                "(or namesrv in [proxy], TXMQ_PROXY_NAMESRV)"
            )
        self.config = config
        self.link = ClusterLink(config)
        self.endpoint = GrpcEndpoint(self.core(), what="proxy", optional=False)

    def core(self) -> BrokerCore:
        """What the endpoint calls: the cluster, through :attr:`link`."""
        cfg, link = self.config, self.link
        return BrokerCore(
            broker_name="",  # every transaction id and receipt handle names its broker set
            host=cfg.host,
            grpc_port=cfg.grpc_port,
            advertised_address=cfg.advertised_address,
            max_message_size=cfg.max_message_size,
            max_frame_size=cfg.max_frame_size,
            retry_delays_ms=cfg.retry_delays_ms,
            routes=_Routes(link),
            send=link.send,
            half_group=link.half_group,
            end_transaction=link.end_transaction,
            pop=ProxyPops(link),
            group_policy=link.group_policy,
            producers=link.producers,
            tls=cfg.server_tls(),
        )

    @property
    def address(self) -> str:
        """Where clients reach the proxy (once started)."""
        return self.endpoint.address()

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[Proxy] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._stop = anyio.Event()
        await self.link.start()
        try:
            await self.endpoint.start()
            _warn_if_exposed(self.config)
            log.info(
                "proxy on %s for the cluster of %s",
                self.address,
                ";".join(self.config.namesrv_addresses),
            )
            task_status.started(self)
            await self._stop.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await self.endpoint.stop()
                await self.link.stop()


class _Routes:
    """The link's queue sets as the endpoint's RouteSource."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link

    async def route(self, topic: str, create: bool) -> list[QueueSet]:
        return await self.link.queue_sets(topic, create)


def _warn_if_exposed(config: ProxyConfig) -> None:
    """One warning line when the proxy listens beyond this machine: it does not
    authenticate clients (they act as the proxy's user on the brokers), nor, without TLS,
    encrypt."""
    try:
        if ipaddress.ip_address(config.host).is_loopback:
            return
    except ValueError:
        if config.host == "localhost":
            return
    log.warning(
        "proxy listens on %s: it does not authenticate clients, who act on the brokers as "
        "its own user (TXMQ_PROXY_ACCESS_KEY); keep it behind your network's access "
        "control%s",
        config.host or "every address",
        "" if config.tls_cert is not None else ", and give it TLS (--tls-cert/--tls-key)",
    )
