"""txmq.observability.hooks without servers: the trace context's round trip through message
properties, hooks that do nothing without a tracer provider or a registry, metrics in a private
registry, and txmq without opentelemetry installed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from tests.conftest import ROOT
from tests.observe_support import recorded, registry, spans
from txmq.observability import hooks as observe

__all__ = ["registry", "spans"]  # fixtures


@pytest.fixture
def no_metrics() -> Iterator[None]:
    before = observe._registry
    observe.use_registry(None)
    try:
        yield
    finally:
        observe.use_registry(before)


def _props(msg_id: str = "ID1") -> dict[str, str]:
    return {"UNIQ_KEY": msg_id, "TAGS": "created", "KEYS": "order-1 o1", "note": "x"}


def test_the_trace_context_goes_round_trip_through_the_properties(
    spans: InMemorySpanExporter, no_metrics: None
) -> None:
    props = _props()
    with observe.sending("orders", "producers", [props], 12) as obs:
        obs.sent(3, "broker-a")
    assert props["traceparent"].startswith("00-")
    assert props["note"] == "x"  # the user's own properties stay
    # what a consumer receives: the stored properties
    with observe.consuming("billing", "orders", "ID1", dict(props), queue_id=3) as c:
        c.result("success")
    send, process = spans.get_finished_spans()
    assert send.name == "send orders" and send.kind is SpanKind.PRODUCER
    assert process.name == "process orders" and process.kind is SpanKind.CONSUMER
    assert process.context.trace_id == send.context.trace_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert send.attributes is not None and process.attributes is not None
    assert send.attributes["messaging.system"] == "rocketmq"
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.destination.name"] == "orders"
    assert send.attributes["messaging.message.id"] == "ID1"
    assert send.attributes["messaging.destination.partition.id"] == "3"
    assert send.attributes["messaging.rocketmq.message.tag"] == "created"
    assert send.attributes["messaging.rocketmq.message.keys"] == ("order-1", "o1")
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.attributes["messaging.consumer.group.name"] == "billing"
    assert process.attributes["messaging.message.id"] == "ID1"
    assert "txmq.consume.result" not in process.attributes  # set when it is not success


def test_a_message_that_carries_a_context_continues_it(
    spans: InMemorySpanExporter, no_metrics: None
) -> None:
    tracer = observe.tracer()
    with tracer.start_as_current_span("request") as request:
        row: dict[str, str] = {}
        observe.capture(row)  # what outbox.add keeps with the row
    assert "traceparent" in row
    props = {**_props(), **row}
    with tracer.start_as_current_span("relay cycle"):  # the relay's own context loses
        with observe.sending("replies", "relay", [props], 3):
            pass
    send = next(s for s in spans.get_finished_spans() if s.name == "send replies")
    assert send.parent is not None
    assert send.parent.span_id == request.get_span_context().span_id
    assert props["traceparent"] != row["traceparent"]  # now: the send span's own


def test_inside_an_unsampled_message_user_spans_and_sends_stay_in_its_trace(
    spans: InMemorySpanExporter, no_metrics: None
) -> None:
    """The carried context of an unsampled message is made current without building its
    span context (built when asked for): a span the listener starts joins the trace, and a
    send from the listener carries the trace on, unsampled."""
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    props = {**_props(), "traceparent": f"00-{trace_id}-{span_id}-00"}
    tracer = observe.tracer()
    out = _props("ID2")
    with observe.consuming("billing", "orders", "ID1", props) as c:
        current = trace.get_current_span().get_span_context()
        assert (current.trace_id, current.span_id) == (int(trace_id, 16), int(span_id, 16))
        assert current.is_remote and not current.trace_flags.sampled
        with tracer.start_as_current_span("charge") as mine:
            assert mine.get_span_context().trace_id == int(trace_id, 16)
            assert not mine.is_recording()  # ParentBased: an unsampled parent's child
        with observe.sending("payments", "billing", [out], 8):
            pass
        c.result("success")
    assert spans.get_finished_spans() == ()
    assert out["traceparent"].startswith(f"00-{trace_id}-") and out["traceparent"][-2:] == "00"


def test_a_failed_send_or_listener_marks_its_span(
    spans: InMemorySpanExporter, no_metrics: None
) -> None:
    with pytest.raises(RuntimeError), observe.sending("orders", "p", [_props()], 1):
        raise RuntimeError("broker gone")
    with observe.consuming("g", "orders", "ID1", {}) as c:
        c.failed(ValueError("bad body"))
    send, process = spans.get_finished_spans()
    assert send.status.status_code is StatusCode.ERROR
    assert process.status.status_code is StatusCode.ERROR
    assert process.parent is None  # an untraced message starts a trace of its own
    assert process.attributes is not None
    assert process.attributes["txmq.consume.result"] == "error"


def test_without_a_tracer_provider_or_a_registry_the_hooks_do_nothing(no_metrics: None) -> None:
    observe.use_tracer_provider(None)  # the global one: none configured in the tests
    assert observe.tracer() is None
    props = _props()
    with observe.sending("orders", "p", [props], 1) as obs:
        obs.sent(1, "b")
    assert props == _props()
    with observe.consuming("g", "orders", "ID1", props) as c:
        c.result("success")
    row: dict[str, str] = {}
    observe.capture(row)
    assert row == {}
    assert observe.metrics() is None
    observe.checkback("g", "COMMIT")
    observe.duplicate_skipped("g")
    observe.outbox_stats(1, 2.0, 3)


def test_metrics_move_in_a_private_registry(registry: CollectorRegistry) -> None:
    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    with observe.sending("orders", "p", [_props()], 1):
        pass
    with pytest.raises(TimeoutError), observe.sending("orders", "p", [_props()], 1):
        raise TimeoutError
    assert value("txmq_client_send_seconds_count", topic="orders", result="ok") == 1
    assert value("txmq_client_send_seconds_count", topic="orders", result="error") == 1
    assert value("txmq_client_send_errors_total", topic="orders", error="TimeoutError") == 1
    for outcome in ("success", "reconsume_later", "success"):
        with observe.consuming("g", "orders", "ID", {}) as c:
            c.result(outcome)
    with observe.consuming("g", "orders", "ID", {}) as c:
        c.failed(ValueError())
    assert value("txmq_client_consume_seconds_count", group="g", topic="orders", result="success")
    assert (
        value("txmq_client_consume_seconds_count", group="g", topic="orders", result="success") == 2
    )
    assert value("txmq_client_consume_seconds_count", group="g", topic="orders", result="error")
    observe.checkback("p", "COMMIT")
    observe.duplicate_skipped("g")
    observe.duplicate_skipped("g")
    observe.outbox_stats(7, 1.5, 2)
    assert value("txmq_client_checkback_total", group="p", state="COMMIT") == 1
    assert value("txmq_idempotent_duplicates_total", group="g") == 2
    assert value("txmq_outbox_backlog_rows") == 7
    assert value("txmq_outbox_lag_seconds") == 1.5
    assert value("txmq_outbox_parked_rows") == 2
    # a second use of the same registry finds the collectors already there
    observe.use_registry(registry)
    observe.duplicate_skipped("g")
    assert value("txmq_idempotent_duplicates_total", group="g") == 3


def test_txmq_works_without_opentelemetry_installed() -> None:
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import txmq, txmq.sync, txmq.outbox\n"
        "from txmq.observability import hooks as observe\n"
        "assert observe.tracer() is None\n"
        "props = {'UNIQ_KEY': 'x'}\n"
        "with observe.sending('t', 'g', [props], 1): pass\n"
        "with observe.consuming('g', 't', 'x', props) as c: c.result('success')\n"
        "observe.capture(props)\n"
        "assert props == {'UNIQ_KEY': 'x'}, props\n"
        "assert 'opentelemetry.trace' not in sys.modules\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


class _EveryOther(Sampler):
    """Keeps every other root it is asked about, whatever its trace id."""

    def __init__(self) -> None:
        self.asked = 0

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        self.asked += 1
        return SamplingResult(Decision.RECORD_AND_SAMPLE if self.asked % 2 else Decision.DROP)

    def get_description(self) -> str:
        return "EveryOther"


@pytest.mark.parametrize(
    "sampler",
    [
        ParentBased(TraceIdRatioBased(0.5)),  # judged from the trace id by txmq itself
        ParentBased(_EveryOther()),  # judged by the sampler, once a span
    ],
    ids=["ratio", "custom"],
)
def test_roots_a_sampler_drops_get_no_span_and_the_kept_ones_keep_the_rate(
    sampler: Any, no_metrics: None
) -> None:
    """A root send the sampler drops builds no span but carries its unsampled context on;
    a kept one is the SDK's span, with the trace id the verdict was given on — so the rate
    is the sampler's (were the SDK to draw and judge again, half of a half would record)."""
    with recorded(sampler) as exporter:
        sent = []
        for i in range(1000):
            props = _props(f"ID{i}")
            with observe.sending("orders", "producers", [props], 12):
                pass
            sent.append(props["traceparent"])
        kept_spans = {s.context.trace_id: s for s in exporter.get_finished_spans()}
        kept = [p for p in sent if int(p[-2:], 16) & 1]
        assert 400 < len(kept_spans) < 600, len(kept_spans)
        assert len(kept) == len(kept_spans)
        for parent in kept:  # each kept root is the span its traceparent names
            span = kept_spans[int(parent[3:35], 16)]
            assert parent[:52] == f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}"
        dropped = [p for p in sent if not int(p[-2:], 16) & 1]
        assert len(dropped) == 1000 - len(kept)
        assert len({p[3:35] for p in sent}) == 1000  # a trace each
        # the consumer of a dropped root makes no span, and runs inside its context
        with observe.consuming("billing", "orders", "ID0", {"traceparent": dropped[0]}):
            current = trace.get_current_span().get_span_context()
        assert f"{current.trace_id:032x}" == dropped[0][3:35] and not current.trace_flags.sampled
        assert len(exporter.get_finished_spans()) == len(kept_spans)
