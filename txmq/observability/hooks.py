"""Client metrics (``prometheus_client``) and traces (the OpenTelemetry API), in one place.

The client core calls the hooks below at a few points — a send (plain, batch or the half
message of a transaction), a listener's run, a check-back's answer, a duplicate skipped by
``txmq.idempotent``, the outbox relay's view of its table — whatever the transport.

**Metrics** go to ``prometheus_client.REGISTRY`` unless :func:`use_registry` says otherwise
(once per process: a private ``CollectorRegistry``, or ``None`` to turn them off)::

    txmq_client_send_seconds{topic, result="ok"|"error"}            histogram
    txmq_client_send_errors_total{topic, error}                      counter (error class)
    txmq_client_consume_seconds{group, topic, result}                histogram
        result: "success", "reconsume_later" (asked for), "dead_letter" (sent to the DLQ on
        purpose) or "error" (the listener raised)
    txmq_client_checkback_total{group, state}                        counter
        state: COMMIT, ROLLBACK, UNKNOWN or ERROR (the checker raised)
    txmq_idempotent_duplicates_total{group}                          counter
    txmq_outbox_backlog_rows, txmq_outbox_lag_seconds, txmq_outbox_parked_rows   gauges

**Traces**: with ``opentelemetry-api`` installed (``pip install txmq[otel]``) and a tracer
provider configured (the SDK's, or one given to :func:`use_tracer_provider`), a send makes
a PRODUCER span ``send <topic>`` and writes its W3C trace context (``traceparent``,
``tracestate``) into the message's user properties; a push consumer runs the listener inside
a CONSUMER span ``process <topic>`` whose parent is that context (OpenTelemetry's
recommendation for a single message's processing), so producer and consumer share one
trace, through retries (``%RETRY%``) and into the DLQ, which keep user properties.  A
message that already carries a trace context (an outbox row: ``outbox.add`` captures the
context current when it is called) continues that trace: the relay's send is its child.
Spans follow OpenTelemetry's messaging semantic conventions with ``messaging.system`` =
``"rocketmq"``: txmq speaks RocketMQ's model (topics, queues, tags, keys, consumer groups,
transactional messages), so the ``messaging.rocketmq.*`` attributes apply as they are.

Without ``opentelemetry-api``, or with no provider configured, the hooks skip tracing after
one check (no span objects, nothing written into the properties).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, MutableMapping
from types import TracebackType
from typing import Any

from txmq.observability import otel
from txmq.observability.dist import DistCollector
from txmq.observability.otel import tracer, tracer_provider, use_tracer_provider

__all__ = [
    "SYSTEM",
    "TRACE_PROPERTIES",
    "capture",
    "checkback",
    "consuming",
    "duplicate_skipped",
    "metrics",
    "outbox_stats",
    "sending",
    "tracer",
    "tracer_provider",
    "use_registry",
    "use_tracer_provider",
]

_perf_counter = time.perf_counter
SYSTEM = "rocketmq"
"""``messaging.system`` of txmq's spans (see the module documentation)."""
TRACE_PROPERTIES = ("traceparent", "tracestate")
"""The user properties a W3C trace context travels in."""

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# -- metrics --------------------------------------------------------------------------------

_DEFAULT: Any = object()
_registry: Any = _DEFAULT
_metrics: tuple[Any, _Metrics] | None = None
_lock = threading.Lock()


def use_registry(registry: Any) -> None:
    """Where the client metrics go from now on: a ``prometheus_client.CollectorRegistry``,
    or ``None`` (no client metrics).  Default: ``prometheus_client.REGISTRY`` when
    ``prometheus_client`` is installed."""
    global _registry, _metrics
    with _lock:
        _registry, _metrics = registry, None


class _Metrics:
    """The client's collectors in one registry."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge

        def made(name: str) -> Any:
            """The collector an earlier use of this registry registered ``name`` by."""
            names = getattr(registry, "_names_to_collectors", {})
            return names.get(name) or names.get(name + "_total")

        def make(kind: Any, name: str, doc: str, labels: Iterable[str] = ()) -> Any:
            try:
                return kind(name, doc, list(labels), registry=registry)
            except ValueError:  # already there
                found = made(name)
                if found is None:
                    raise
                return found

        def histogram(name: str, doc: str, labels: Iterable[str]) -> DistCollector:
            # a DistCollector, not prometheus_client's Histogram: these two run for every
            # message, and its observe() costs several times as much (txmq/dist.py)
            found = made(name)
            if isinstance(found, DistCollector):
                return found
            if found is not None:
                raise ValueError(f"the registry has a {name} of its own: txmq cannot use it")
            collector = DistCollector(name, doc, labels, _LATENCY_BUCKETS)
            registry.register(collector)
            return collector

        self.send_seconds = histogram(
            "txmq_client_send_seconds",
            "Sends (a message, a batch or a transaction's half message): time to the broker's "
            "answer, by topic and result (ok, error)",
            ("topic", "result"),
        )
        self.send_errors = make(
            Counter,
            "txmq_client_send_errors_total",
            "Sends that failed, by topic and error class",
            ("topic", "error"),
        )
        self.consume_seconds = histogram(
            "txmq_client_consume_seconds",
            "Listener runs, by consumer group, topic and result (success, reconsume_later, "
            "dead_letter, error)",
            ("group", "topic", "result"),
        )
        self.checkbacks = make(
            Counter,
            "txmq_client_checkback_total",
            "Answers to the broker's transaction check-backs, by producer group and state",
            ("group", "state"),
        )
        self.duplicates = make(
            Counter,
            "txmq_idempotent_duplicates_total",
            "Messages skipped by txmq.idempotent as already consumed, by dedupe group",
            ("group",),
        )
        self.outbox_backlog = make(
            Gauge, "txmq_outbox_backlog_rows", "Outbox rows waiting to be sent (the relay's view)"
        )
        self.outbox_lag = make(
            Gauge, "txmq_outbox_lag_seconds", "Age of the oldest unsent outbox row (0: none)"
        )
        self.outbox_parked = make(
            Gauge, "txmq_outbox_parked_rows", "Outbox rows parked after their last attempt"
        )
        self.sagas = make(
            Counter,
            "txmq_sagas_total",
            "Sagas that reached a state (RUNNING: started; CONFIRMING, COMPENSATING, PARKED, "
            "COMPLETED, COMPENSATED), by saga name, as their coordinator committed it",
            ("saga", "state"),
        )
        self.saga_steps = histogram(
            "txmq_saga_step_seconds",
            "Saga operations, from the coordinator's command to the participant's answer, by "
            "saga, branch, operation (action, confirm, compensation) and outcome (done, "
            "refused, failed)",
            ("saga", "branch", "op", "outcome"),
        )
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered (labels() takes a lock and builds a key)."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


def metrics() -> _Metrics | None:
    """The client's collectors in the registry in use; None when metrics are off."""
    global _registry, _metrics
    made = _metrics
    if made is not None and made[0] is _registry:
        return made[1]
    if _registry is None:
        return None
    with _lock:
        if _registry is _DEFAULT:
            try:
                import prometheus_client
            except ImportError:
                _registry = None
                return None
            _registry = prometheus_client.REGISTRY
        if _metrics is None or _metrics[0] is not _registry:
            _metrics = (_registry, _Metrics(_registry))
        return _metrics[1]


# -- tracing (txmq.observability.otel) ------------------------------------------------------


def capture(properties: MutableMapping[str, str]) -> None:
    """Write the current trace context into ``properties`` (what ``outbox.add`` keeps with
    the row, for the relay's send to continue), unless they already carry one."""
    if TRACE_PROPERTIES[0] in properties:
        return
    found = otel.active()
    if found is not None:
        found.api.inject(properties)


class _Nothing:
    """What the hooks give when neither metrics nor traces are on."""

    __slots__ = ()

    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def sent(self, queue_id: int, broker_name: str) -> None:
        return None

    def result(self, result: str) -> None:
        return None

    def failed(self, exc: BaseException) -> None:
        return None


_NOTHING = _Nothing()


class _Sending:
    """One send: its spans (one per message), its latency and result."""

    __slots__ = ("began", "m", "spans", "topic")

    def __init__(self, topic: str, m: _Metrics | None, spans: list[Any]) -> None:
        self.topic, self.m, self.spans = topic, m, spans
        self.began = _perf_counter()

    def __enter__(self) -> _Sending:
        return self

    def sent(self, queue_id: int, broker_name: str) -> None:
        """Where the broker stored it."""
        for span in self.spans:
            span.set_attribute("messaging.destination.partition.id", str(queue_id))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        m = self.m
        if m is not None:
            took = _perf_counter() - self.began
            m.send_seconds.observe((self.topic, "ok" if exc is None else "error"), took)
            if exc is not None:
                m.child(m.send_errors, self.topic, type(exc).__name__).inc()
        for span in self.spans:
            if exc is not None:
                _failed_span(span, exc)
            span.end()


def _failed_span(span: Any, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.record_exception(exc)
    span.set_attribute("error.type", type(exc).__name__)
    span.set_status(Status(StatusCode.ERROR, str(exc) or None))


def sending(
    topic: str,
    group: str,
    messages: list[dict[str, str]],
    body_size: int,
    message_type: str = "normal",
) -> _Sending | _Nothing:
    """The hook around a send of ``messages`` (their wire properties, which get the trace
    context of their ``send <topic>`` span): use as ``with ...: ...``."""
    m = metrics()
    traced = otel.active()
    if traced is None:
        return _NOTHING if m is None else _Sending(topic, m, [])
    api = traced.api
    name = f"send {topic}"
    spans = []
    for props in messages:
        carried = TRACE_PROPERTIES[0] in props
        # the context the message carries, else the current one
        parent, sampled = api.extract(props) if carried else api.current()
        if sampled is False:
            # a trace not sampled upstream: no span; its context goes on as it came, so
            # that the consumer's side (and what it sends on) stays in it, unsampled too
            if not carried:
                api.inject(props)
            continue
        roots = traced.roots
        if sampled is None and roots is not None:
            dropped = roots.judge()
            if dropped is not None:  # a root the sampler drops: its context goes on, no span
                api.inject_span(props, dropped, parent)
                continue
        first = _first("send", topic)
        span = traced.tracer.start_span(name, context=parent, kind=api.producer, attributes=first)
        if span.is_recording():
            attributes: dict[str, Any] = {
                "messaging.operation.name": "send",
                "messaging.rocketmq.client_group": group,
                "messaging.rocketmq.message.type": message_type,
            }
            if len(messages) > 1:
                attributes["messaging.batch.message_count"] = len(messages)
            _message_attributes(attributes, props)
            span.set_attributes(attributes)
            spans.append(span)
        api.inject(props, api.trace.set_span_in_context(span))
    return _Sending(topic, m, spans)


def _first(operation: str, topic: str) -> dict[str, Any]:
    """The attributes of ``<operation> <topic>`` a sampler may look at; the rest are set
    only on a span that records."""
    return {
        "messaging.system": SYSTEM,
        "messaging.operation.type": operation,
        "messaging.destination.name": topic,
    }


def _message_attributes(attributes: dict[str, Any], props: Mapping[str, str]) -> None:
    msg_id = props.get("UNIQ_KEY")
    if msg_id:
        attributes["messaging.message.id"] = msg_id
    tag = props.get("TAGS")
    if tag:
        attributes["messaging.rocketmq.message.tag"] = tag
    keys = props.get("KEYS")
    if keys:
        attributes["messaging.rocketmq.message.keys"] = [k for k in keys.split(" ") if k]
    group = props.get("SHARDING_KEY")
    if group:
        attributes["messaging.rocketmq.message.group"] = group


class _Consuming:
    """One listener run: inside a ``process <topic>`` span (current while it runs), or
    inside the message's trace context when it was not sampled (``context``: no span)."""

    __slots__ = ("api", "began", "context", "group", "m", "outcome", "span", "token", "topic")

    def __init__(
        self,
        group: str,
        topic: str,
        m: _Metrics | None,
        api: otel.Otel | None = None,
        span: Any = None,
        context: Any = None,
    ) -> None:
        self.group, self.topic, self.m, self.api, self.span = group, topic, m, api, span
        self.context = context
        self.outcome = "success"
        self.token: Any = None
        self.began = 0.0

    def __enter__(self) -> _Consuming:
        api = self.api
        if api is not None:
            context = self.context
            if context is None:
                context = api.trace.set_span_in_context(self.span)
            self.token = api.context.attach(context)
        self.began = _perf_counter()
        return self

    def result(self, result: str) -> None:
        """``"success"``, ``"reconsume_later"`` or ``"dead_letter"``."""
        self.outcome = result

    def failed(self, exc: BaseException) -> None:
        """The listener raised ``exc``."""
        self.outcome = "error"
        if self.span is not None:
            _failed_span(self.span, exc)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        m = self.m
        if m is not None:
            took = _perf_counter() - self.began
            m.consume_seconds.observe((self.group, self.topic, self.outcome), took)
        if self.token is not None:
            assert self.api is not None
            self.api.context.detach(self.token)
        span = self.span
        if span is not None:
            if self.outcome != "success":
                span.set_attribute("txmq.consume.result", self.outcome)
            if exc is not None:
                _failed_span(span, exc)
            span.end()


def consuming(
    group: str,
    topic: str,
    msg_id: str,
    properties: Mapping[str, str],
    *,
    queue_id: int = -1,
    reconsume_times: int = 0,
    body_size: int = 0,
    model: str = "clustering",
) -> _Consuming | _Nothing:
    """The hook around a listener's run on one message: use as ``with ... as c:`` and tell
    it ``c.result(...)`` or ``c.failed(exc)``."""
    m = metrics()
    traced = otel.active()
    if traced is None:
        return _NOTHING if m is None else _Consuming(group, topic, m)
    api = traced.api
    # the message's context, or none: a message sent untraced starts a trace of its own
    parent, sampled = api.extract(properties)
    if sampled is False:
        return _Consuming(group, topic, m, api, context=parent)  # carried on, no span
    roots = traced.roots
    if sampled is None and roots is not None:
        dropped = roots.judge()
        if dropped is not None:  # a root the sampler drops: its context goes on, no span
            return _Consuming(group, topic, m, api, context=api.context_of(dropped, parent))
    name = f"process {topic}"
    first = _first("process", topic)
    first["messaging.consumer.group.name"] = group
    span = traced.tracer.start_span(name, context=parent, kind=api.consumer, attributes=first)
    if not span.is_recording():
        # dropped by the sampler: nothing to end, but its (unsampled) context goes on
        context = api.trace.set_span_in_context(span, parent)
        return _Consuming(group, topic, m, api, context=context)
    attributes: dict[str, Any] = {"messaging.operation.name": "process"}
    if queue_id >= 0:
        attributes["messaging.destination.partition.id"] = str(queue_id)
    if reconsume_times:
        attributes["txmq.reconsume_times"] = reconsume_times
    if model != "clustering":
        attributes["messaging.rocketmq.consumption_model"] = model
    _message_attributes(attributes, properties)
    attributes["messaging.message.id"] = msg_id
    span.set_attributes(attributes)
    return _Consuming(group, topic, m, api, span)


# -- counters and gauges --------------------------------------------------------------------


def checkback(group: str, state: str) -> None:
    """A check-back was answered ``state`` (COMMIT, ROLLBACK, UNKNOWN; ERROR: it raised)."""
    m = metrics()
    if m is not None:
        m.child(m.checkbacks, group, state).inc()


def duplicate_skipped(group: str) -> None:
    """``txmq.idempotent`` skipped a message already consumed by ``group``."""
    m = metrics()
    if m is not None:
        m.child(m.duplicates, group).inc()


def saga_state(saga: str, state: str) -> None:
    """A saga's coordinator committed its move to ``state``."""
    m = metrics()
    if m is not None:
        m.child(m.sagas, saga, state).inc()


def saga_step(saga: str, branch: str, op: str, outcome: str, seconds: float) -> None:
    """A saga's coordinator took an answer to one of its commands, ``seconds`` after it
    sent the command."""
    m = metrics()
    if m is not None:
        m.child(m.saga_steps, saga, branch, op, outcome).observe(seconds)


def outbox_stats(backlog: int, lag_seconds: float, parked: int) -> None:
    """The outbox as its relay last saw it."""
    m = metrics()
    if m is not None:
        m.outbox_backlog.set(backlog)
        m.outbox_lag.set(lag_seconds)
        m.outbox_parked.set(parked)
