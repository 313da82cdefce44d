"""The broker's ``GET /metrics`` endpoint: which port it binds and the HTTP exchange.

``metrics_port`` -1 (the default) is port 5557 (the RocketMQ exporter's) or, when that is
taken (a second broker on this machine), the next free port after it, said in a warning
and in the broker's start-up line; a port the user chose is that port or no start.  The
endpoint is an HTTP handler on the broker's own event loop (see :mod:`txmq.broker.metrics`
for what it serves).
"""

from __future__ import annotations

import errno
import logging

import anyio
import anyio.abc
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from txmq.server.serving import ListenerUnavailable

__all__ = [
    "DEFAULT_METRICS_PORT",
    "DEFAULT_METRICS_TRIES",
    "metrics_url",
    "start_metrics",
]

log = logging.getLogger("txmq.broker")

#: the RocketMQ exporter's port
DEFAULT_METRICS_PORT = 5557
#: a broker on the default port that finds it taken (another broker on this machine) tries
#: the next ports (5558, 5559, ...: what a scrape configuration can list) before any free one
DEFAULT_METRICS_TRIES = 10
_MAX_REQUEST_HEAD = 8192
_READ_TIMEOUT_S = 10.0


def metrics_url(host: str, port: int) -> str:
    """Where ``/metrics`` is served (an IPv6 host in brackets)."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/metrics"


def _why(exc: OSError) -> str:
    return "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc})"


async def _bind(host: str, port: int) -> anyio.abc.Listener[anyio.abc.SocketStream]:
    return await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)


async def _default_listener(host: str) -> anyio.abc.Listener[anyio.abc.SocketStream] | None:
    """A listener on the default port, else on the next free of the following ports, else
    on any free port (said in a warning: a scrape of 5557 does not reach this broker);
    None (metrics off, said) when nothing can be bound on ``host``."""
    tries = [DEFAULT_METRICS_PORT + i for i in range(DEFAULT_METRICS_TRIES)] + [0]
    first: OSError | None = None
    for port in tries:
        try:
            listener = await _bind(host, port)
        except OSError as exc:
            first = first or exc
            continue
        if first is not None:
            bound = int(listener.extra(anyio.abc.SocketAttribute.local_port))
            log.warning(
                "metrics on %s: the default port %d %s (another broker on this machine?); "
                "choose one with --metrics-port N",
                metrics_url(host, bound),
                DEFAULT_METRICS_PORT,
                _why(first),
            )
        return listener
    assert first is not None
    log.warning(
        "metrics off: port %s:%d %s, and no other port could be bound",
        host,
        DEFAULT_METRICS_PORT,
        _why(first),
    )
    return None


async def start_metrics(
    tg: anyio.abc.TaskGroup, registry: CollectorRegistry, host: str, chosen: int
) -> int:
    """Serve ``/metrics`` in ``tg`` on ``host``: port ``chosen``; for -1 the default (5557)
    or, when that is taken, the next free port after it (see :func:`_default_listener`).
    Returns the bound port (0: off).  A chosen port that cannot be bound raises
    :class:`ListenerUnavailable` (who names a port expects that one, not another)."""
    if chosen == 0:
        return 0
    if chosen < 0:
        listener = await _default_listener(host)
        if listener is None:
            return 0
    else:
        try:
            listener = await _bind(host, chosen)
        except OSError as exc:
            raise ListenerUnavailable(
                f"the metrics port {host}:{chosen} {_why(exc)}; choose another with "
                "--metrics-port N, leave the option out for 5557 or the next free port, "
                "or turn metrics off with --metrics-port 0"
            ) from None
    bound = int(listener.extra(anyio.abc.SocketAttribute.local_port))

    async def serve() -> None:
        async with listener:
            await listener.serve(lambda stream: _answer(stream, registry))

    tg.start_soon(serve)
    return bound


async def _answer(stream: anyio.abc.SocketStream, registry: CollectorRegistry) -> None:
    """One HTTP/1.0-style exchange: ``GET /metrics`` -> the text format; then close."""
    async with stream:
        head = b""
        with anyio.move_on_after(_READ_TIMEOUT_S):
            try:
                while b"\r\n\r\n" not in head and b"\n\n" not in head:
                    chunk = await stream.receive(4096)
                    head += chunk
                    if len(head) > _MAX_REQUEST_HEAD:
                        break
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return
        line = head.split(b"\n", 1)[0].decode("latin-1").strip().split()
        if len(line) < 2:
            status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
        elif line[0] not in ("GET", "HEAD"):
            status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
        elif line[1].split("?", 1)[0] not in ("/metrics", "/"):
            status, ctype, body = "404 Not Found", "text/plain", b"try /metrics\n"
        else:
            status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest(registry)
        reply = (
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        if line and line[0] == "HEAD":
            body = b""
        try:
            await stream.send(reply + body)
        except (anyio.BrokenResourceError, OSError):
            pass
