"""The orders example's HTTP front (examples/orders/web.py): a tiny route set served by
JsonServer (FastAPI on uvicorn) on a free port — JSON in and out, each error mapped to its
status with ``{"error": ...}``, the SERVER span continuing the caller's trace in the
handler's thread, and a stopped server's port closed."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from examples.orders.web import JsonServer, Request, request
from tests.observe_support import spans
from txmq.protocol.wire.errors import BrokerUnavailable, TopicNotFound

__all__ = ["spans"]  # fixtures

#: what the handlers saw: the thread each ran in, and the span current there
seen: dict[str, Any] = {}


def echo(req: Request) -> tuple[int, Any]:
    seen["thread"] = threading.current_thread()
    seen["span"] = trace.get_current_span().get_span_context()
    return 201, {"name": req.path["name"], "body": req.body, "q": req.param("q")}


def fails(req: Request) -> tuple[int, Any]:
    raise {
        "lookup": LookupError("no such thing"),
        "value": ValueError("quantity must be a whole number"),
        "type": TypeError("expected a list"),
        "down": BrokerUnavailable("broker-a is down"),
        "txmq": TopicNotFound("no topic"),
        "bug": RuntimeError("oops"),
    }[req.path["how"]]


ROUTES = {("POST", "/echo/{name}"): echo, ("GET", "/fail/{how}"): fails}


@pytest.fixture
def server() -> Iterator[JsonServer]:
    seen.clear()
    s = JsonServer(ROUTES)
    assert s.url.startswith("http://127.0.0.1:") and s.address[1] > 0  # known before start
    s.start()
    try:
        yield s
    finally:
        s.stop()


def test_json_round_trip_in_a_worker_thread(server: JsonServer) -> None:
    body = {"items": [1, 2.5, None], "note": "ünïcode"}
    assert request(server.url, "POST", "/echo/apple?q=7", body) == (
        201,
        {"name": "apple", "body": body, "q": "7"},
    )
    # the plain handler ran in FastAPI's thread pool: neither here nor on uvicorn's loop
    assert seen["thread"] is not threading.current_thread()
    assert seen["thread"].name != f"http {server.url}"
    assert any(t.name == f"http {server.url}" for t in threading.enumerate())
    assert request(server.url, "POST", "/echo/pear")[1] == {"name": "pear", "body": None, "q": None}


@pytest.mark.parametrize(
    ("how", "status", "error"),
    [
        ("lookup", 404, "no such thing"),
        ("value", 400, "quantity must be a whole number"),
        ("type", 400, "expected a list"),
        ("down", 503, "BrokerUnavailable: broker-a is down"),
        ("txmq", 500, "TopicNotFound: no topic"),
        ("bug", 500, "RuntimeError: oops"),
    ],
)
def test_errors_map_to_statuses(server: JsonServer, how: str, status: int, error: str) -> None:
    assert request(server.url, "GET", f"/fail/{how}") == (status, {"error": error})


def test_a_body_that_is_not_json_is_400(server: JsonServer) -> None:
    # urllib's default Content-Type (a form): the body is read as JSON all the same
    bad = urllib.request.Request(server.url + "/echo/x", data=b"{nope", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(bad, timeout=10)
    with info.value as answer:
        assert answer.code == 400
        assert answer.headers["Content-Type"] == "application/json"
        assert answer.read() == b'{"error": "the request body is not JSON"}'
    assert "thread" not in seen  # the handler never ran


def test_no_route_is_404_and_another_method_405(server: JsonServer) -> None:
    assert request(server.url, "GET", "/nowhere") == (
        404,
        {"error": "no route for GET /nowhere"},
    )
    assert request(server.url, "POST", "/fail/lookup", {}) == (
        405,
        {"error": "/fail/lookup does not take POST"},
    )
    assert "thread" not in seen


def test_the_span_continues_the_callers_trace_in_the_handlers_thread(
    server: JsonServer, spans: InMemorySpanExporter
) -> None:
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    call = urllib.request.Request(
        server.url + "/echo/fig",
        data=b"{}",
        method="POST",
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    with urllib.request.urlopen(call, timeout=10) as answer:
        assert answer.status == 201
    [span] = spans.get_finished_spans()
    assert span.name == "POST /echo/{name}" and span.kind is trace.SpanKind.SERVER
    assert span.parent is not None and span.parent.span_id == int(parent_id, 16)
    assert span.context is not None and span.context.trace_id == int(trace_id, 16)
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 201
    assert span.attributes["url.path"] == "/echo/fig"
    # current in the thread that ran the handler
    assert seen["span"].span_id == span.context.span_id


def test_stop_closes_the_port() -> None:
    s = JsonServer(ROUTES).start()
    host, port = s.address
    socket.create_connection((host, port), timeout=5).close()  # accepting once started
    s.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=5)
    # and it can be bound again at once (nothing holds it)
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind((host, port))


def test_a_server_never_started_frees_its_port_on_stop() -> None:
    s = JsonServer(ROUTES)
    host, port = s.address
    s.stop()
    with socket.socket() as again:
        again.bind((host, port))
