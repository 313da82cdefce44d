"""The services' JSON-over-HTTP fronts — each a FastAPI application served by uvicorn from a
background thread — and a client.

Routes are ``(method, path)`` → ``handler(request) -> (status, data)``, the path in
FastAPI's syntax (``/orders/{id}``), where the request has the path's parameters
(``path``), the decoded JSON ``body`` (None: no body) and the ``query`` parameters.
Handlers are plain functions (they call txmq's blocking clients and SQLAlchemy): FastAPI
runs them in its thread pool.  Errors map to statuses: ``ValueError`` and ``TypeError``
400, ``LookupError`` 404, a retriable txmq error (broker down, timeout) 503, anything else
500; a body that is not JSON 400, a path no route has 404 — always with
``{"error": "..."}``.

Traced when txmq traces (:mod:`txmq.observability.hooks`: an OpenTelemetry tracer provider is set):
each request runs in a SERVER span ``METHOD /route`` continuing the caller's
``traceparent`` header, current in the thread that runs the handler, so the messages a
request sends, and their consumers, are in the request's trace; :func:`request` sends the
current trace context along.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qs

import uvicorn
from fastapi import Depends, FastAPI, Response
from fastapi import Request as HttpRequest
from starlette.exceptions import HTTPException

from txmq.observability import hooks as observe
from txmq.protocol.wire.errors import TxmqError

__all__ = ["Handler", "JsonServer", "Request", "json_app", "request"]

log = logging.getLogger("examples.orders.web")

#: seconds stop() gives the requests in flight before uvicorn cancels them
GRACE_S = 5


@dataclass(frozen=True)
class Request:
    path: Mapping[str, str]
    """The route's path parameters (``{"id": ...}`` for ``/orders/{id}``)."""
    body: Any
    query: dict[str, list[str]]

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None


Handler = Callable[[Request], tuple[int, Any]]


def json_app(routes: Mapping[tuple[str, str], Handler]) -> FastAPI:
    """A FastAPI application of ``routes``: one sync endpoint each, with the error mapping
    and the SERVER span; no OpenAPI pages (the routes take and give untyped JSON)."""
    options: dict[str, Any] = {}
    if "telemetry" in inspect.signature(FastAPI).parameters:
        # newer FastAPI traces requests itself once a global tracer provider is set: the
        # front makes its own span (with txmq's provider), one SERVER span per request
        options["telemetry"] = {"tracing": False}
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, **options)
    app.add_exception_handler(HTTPException, _no_route)
    for (method, path), handler in routes.items():
        app.add_api_route(
            path,
            _endpoint(method, path, handler),
            methods=[method],
            name=getattr(handler, "__name__", path),
        )
    return app


class JsonServer:
    """Serves ``routes`` (a :func:`json_app`) with uvicorn on ``host:port`` (0: any free
    port), from a background thread; the port is bound here, so :attr:`url` is known
    before :meth:`start`."""

    def __init__(
        self,
        routes: Mapping[tuple[str, str], Handler],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.app = json_app(routes)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            # (as http.server did) a restarted service binds its port again at once
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
        except BaseException:
            self.socket.close()
            raise
        #: the (host, port) it serves on
        self.address: tuple[str, int] = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            self.app,
            # the services' own logging stays as it is: uvicorn adds no handler of its own,
            # says only warnings and errors, and logs no access lines
            log_config=None,
            log_level="warning",
            access_log=False,
            # the services start and stop their txmq clients themselves
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=GRACE_S,
        )
        self._server = _Uvicorn(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self, timeout: float = 30.0) -> JsonServer:
        """Start serving; returns once uvicorn accepts connections (RuntimeError if it did
        not within ``timeout`` seconds)."""
        if self._thread is not None:
            raise RuntimeError("the server was started already")
        self._thread = threading.Thread(target=self._serve, name=f"http {self.url}", daemon=True)
        self._thread.start()
        if not self._server.ready.wait(timeout) or not self._server.started:
            self.stop()
            raise RuntimeError(f"the HTTP front on {self.url} did not start (waited {timeout:g} s)")
        return self

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self.socket])
        except BaseException:  # (uvicorn exits with SystemExit when its startup fails)
            log.exception("the HTTP front on %s failed", self.url)
        finally:
            self._server.ready.set()

    def stop(self, timeout: float = GRACE_S + 10) -> None:
        """Stop serving (requests in flight have ``GRACE_S`` seconds to end) and join the
        server's thread; the port is free when this returns."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the HTTP front on %s did not stop within %.0f s", self.url, timeout)
        self.socket.close()  # (uvicorn closed it already, if it started)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, with an event set when its startup has ended (``started``
    tells whether it listens)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.ready.set()


class _Malformed:
    """A request body that is not JSON."""


_MALFORMED = _Malformed()


async def _json_body(request: HttpRequest) -> Any:
    """The request's body, decoded as JSON whatever its Content-Type says (as before)."""
    raw = await request.body()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return _MALFORMED


def _endpoint(method: str, route: str, handler: Handler) -> Callable[..., Response]:
    """The route's FastAPI endpoint: a plain function, so FastAPI runs it in its thread
    pool — the span is current in the thread that runs the handler."""

    def endpoint(request: HttpRequest, body: Annotated[Any, Depends(_json_body)]) -> Response:
        path = request.url.path
        with _server_span(method, route, path, request.headers) as span:
            if body is _MALFORMED:
                status, data = 400, {"error": "the request body is not JSON"}
            else:
                query = parse_qs(request.url.query)
                status, data = _call(handler, path, Request(request.path_params, body, query))
            if span is not None:
                span.set_attribute("http.response.status_code", status)
        return _json(status, data)

    return endpoint


async def _no_route(request: HttpRequest, exc: Exception) -> Response:
    """Routing's own errors (no route for the path; the path's route takes another method)
    in the fronts' shape."""
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        error = f"no route for {method} {path}"
    elif exc.status_code == 405:
        error = f"{path} does not take {method}"
    else:
        error = str(exc.detail)
    return _json(exc.status_code, {"error": error}, exc.headers)


def _json(status: int, data: Any, headers: Mapping[str, str] | None = None) -> Response:
    payload = json.dumps(data, default=str)
    return Response(payload, status, headers, media_type="application/json")


@contextlib.contextmanager
def _server_span(method: str, route: str, path: str, headers: Mapping[str, str]) -> Iterator[Any]:
    """The request's SERVER span, current while it is handled (None: not traced)."""
    provider = observe.tracer_provider()
    if provider is None:
        yield None
        return
    from opentelemetry import propagate, trace

    tracer = provider.get_tracer("examples.orders.web")
    with tracer.start_as_current_span(
        f"{method} {route}",
        context=propagate.extract({k.lower(): v for k, v in headers.items()}),
        kind=trace.SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path, "http.route": route},
    ) as span:
        yield span


def _call(handler: Handler, path: str, request: Request) -> tuple[int, Any]:
    try:
        return handler(request)
    except (ValueError, TypeError) as exc:
        return 400, {"error": str(exc)}
    except LookupError as exc:
        return 404, {"error": str(exc.args[0] if exc.args else exc)}
    except TxmqError as exc:
        error = f"{type(exc).__name__}: {exc}"
        if exc.retriable:  # a broker down, a timeout: the client may try again
            log.info("%s: 503 %s", path, error)
            return 503, {"error": error}
        log.warning("%s: 500 %s", path, error)
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
