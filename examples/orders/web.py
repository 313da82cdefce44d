"""A small JSON-over-HTTP front for the services (standard library only) and a client.

Routes are ``(method, path regex)`` → ``handler(request) -> (status, data)``, where the
request has the path's ``match``, the decoded JSON ``body`` and the ``query`` parameters.
Errors map to statuses: ``ValueError`` 400, ``LookupError`` 404, a retriable txmq error
(broker down, timeout) 503, anything else 500 — always with ``{"error": "..."}``.

Traced when txmq traces (:mod:`txmq.observability.hooks`: an OpenTelemetry tracer provider is set):
each request runs in a SERVER span ``METHOD /route`` continuing the caller's
``traceparent`` header, so the messages a request sends, and their consumers, are in the
request's trace; :func:`request` sends the current trace context along.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from txmq.observability import hooks as observe
from txmq.protocol.wire.errors import TxmqError

__all__ = ["Handler", "JsonServer", "Request", "request"]

log = logging.getLogger("examples.orders.web")


@dataclass(frozen=True)
class Request:
    match: re.Match[str]
    body: Any
    query: dict[str, list[str]]

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None


Handler = Callable[[Request], tuple[int, Any]]


class JsonServer:
    """Serves ``routes`` on ``host:port`` (0: any free port) from a background thread."""

    def __init__(
        self, routes: dict[tuple[str, str], Handler], host: str = "127.0.0.1", port: int = 0
    ) -> None:
        compiled = [(m, re.compile(p + r"\Z"), h) for (m, p), h in routes.items()]

        class RequestHandler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _dispatch(self, method: str) -> None:
                path, _, query = self.path.partition("?")
                status, data = 404, {"error": f"no route for {method} {path}"}
                for m, pattern, handler in compiled:
                    match = pattern.match(path)
                    if match and m == method:
                        with _server_span(
                            method, pattern.pattern, path, dict(self.headers)
                        ) as span:
                            status, data = _call(handler, match, self._body(), parse_qs(query))
                            if span is not None:
                                span.set_attribute("http.response.status_code", status)
                        break
                payload = json.dumps(data, default=str).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _body(self) -> Any:
                size = int(self.headers.get("Content-Length") or 0)
                if not size:
                    return None
                raw = self.rfile.read(size)
                try:
                    return json.loads(raw)
                except ValueError:
                    return _Malformed(raw)

            def do_GET(self) -> None:
                self._dispatch("GET")

            def do_POST(self) -> None:
                self._dispatch("POST")

            def log_message(self, format: str, *args: Any) -> None:
                log.debug(format, *args)

        self.httpd = ThreadingHTTPServer((host, port), RequestHandler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> JsonServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def _server_span(method: str, route: str, path: str, headers: Mapping[str, str]) -> Iterator[Any]:
    """The request's SERVER span, current while it is handled (None: not traced)."""
    provider = observe.tracer_provider()
    if provider is None:
        yield None
        return
    from opentelemetry import propagate, trace

    tracer = provider.get_tracer("examples.orders.web")
    route = route.removesuffix(r"\Z")
    with tracer.start_as_current_span(
        f"{method} {route}",
        context=propagate.extract({k.lower(): v for k, v in headers.items()}),
        kind=trace.SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path, "http.route": route},
    ) as span:
        yield span


class _Malformed:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw


def _call(
    handler: Handler, match: re.Match[str], body: Any, query: dict[str, list[str]]
) -> tuple[int, Any]:
    if isinstance(body, _Malformed):
        return 400, {"error": "the request body is not JSON"}
    try:
        return handler(Request(match, body, query))
    except (ValueError, TypeError) as exc:
        return 400, {"error": str(exc)}
    except LookupError as exc:
        return 404, {"error": str(exc.args[0] if exc.args else exc)}
    except TxmqError as exc:
        error = f"{type(exc).__name__}: {exc}"
        if exc.retriable:  # a broker down, a timeout: the client may try again
            log.info("%s: 503 %s", match.string, error)
            return 503, {"error": error}
        log.warning("%s: 500 %s", match.string, error)
        return 500, {"error": error}
    except Exception as exc:
        log.exception("request failed")
        return 500, {"error": f"{type(exc).__name__}: {exc}"}


def request(
    base_url: str, method: str, path: str, body: Any = None, *, timeout: float = 30.0
) -> tuple[int, Any]:
    """One JSON request; returns (status, decoded body). Connection errors raise OSError."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    observe.capture(headers)  # the current trace context, if traced
    req = urllib.request.Request(base_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read() or b"null")
