"""The OpenTelemetry side of the client hooks (:mod:`txmq.observability.hooks`): which
tracer txmq traces with, W3C trace context in and out of a message's properties, and the
root sends a sampler drops, answered without building a span.

A send with no trace around it starts a trace of its own, and at 1 % sampling 99 of 100
such roots are dropped.  The SDK builds a non-recording span even for those (a trace id, the
sampler's verdict, a span context, a span object, the context it sits in: about 4 µs, as
much as the rest of a send's hooks).  Under the SDK's ``TraceIdRatioBased`` sampler (alone or
as ``ParentBased``'s root: what production tracing at a low rate uses) a root's verdict is a
function of its trace id alone, so :class:`Roots` draws the trace id from the tracer's own id
generator, judges it as the sampler would (checked against the sampler itself on ids either
side of its bound, when the tracer is first used), and for a dropped root only writes the
unsampled ``traceparent`` on, so the consumer's side stays in that (unsampled) trace.  A
root it keeps is started by the SDK with that very trace id (the tracer's generator hands
it out next), so its verdict is the sampler's and its span a plain SDK span.  Any other
sampler is asked by the SDK alone, once per span.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Active",
    "Otel",
    "Roots",
    "Span",
    "active",
    "api",
    "tracer",
    "tracer_provider",
    "use_tracer_provider",
]

#: a span never built: (trace id, span id, trace flags, trace state or None)
Span = tuple[int, int, int, Any]


class Otel:
    """The parts of the OpenTelemetry API the hooks use (imported on first use)."""

    def __init__(self) -> None:
        from opentelemetry import baggage, context, propagate, trace

        self.baggage = baggage
        self.context = context
        self.propagate = propagate
        self.trace = trace
        self.empty = context.Context()
        #: the global propagator last seen, and whether it is OpenTelemetry's default
        #: (W3C trace context + W3C baggage): then the hooks read and write ``traceparent``
        #: themselves, several times cheaper than through the propagator API
        self._propagator: Any = None
        self._w3c = False
        #: set from the environment: the global provider is made on first ask
        self.from_env = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
        self.inactive = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        self.carried = _carried_span_type(trace)
        self.producer = trace.SpanKind.PRODUCER
        self.consumer = trace.SpanKind.CONSUMER

    def w3c(self) -> bool:
        """Whether the global propagator is OpenTelemetry's default one."""
        found = self.propagate.get_global_textmap()
        if found is not self._propagator:
            from opentelemetry.baggage.propagation import W3CBaggagePropagator
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            kinds = [type(p) for p in getattr(found, "_propagators", ())]
            self._propagator = found
            self._w3c = kinds == [TraceContextTextMapPropagator, W3CBaggagePropagator]
        return self._w3c

    def extract(self, props: Mapping[str, str]) -> tuple[Any, bool | None]:
        """``propagate.extract(props)``: the context a message's properties carry, and
        whether the span in it was sampled (None: it holds no valid span)."""
        parent = props.get("traceparent")
        if parent is not None and "tracestate" not in props and "baggage" not in props:
            if self.w3c() and (found := _TRACEPARENT.fullmatch(parent)) is not None:
                if found[1] != _NO_TRACE and found[2] != _NO_SPAN:
                    trace = self.trace
                    if found[3][1] in _UNSAMPLED:
                        # the common case at a low sampling rate: the hooks build no span
                        # under it, so its span context is built only if something asks
                        span: Any = self.carried(found)
                        return trace.set_span_in_context(span, self.empty), False
                    span = trace.NonRecordingSpan(_span_context(trace, found))
                    return trace.set_span_in_context(span, self.empty), True
        context = self.propagate.extract(props)
        return context, self.sampled(context)

    def current(self) -> tuple[Any, bool | None]:
        """The current context (None; or :attr:`empty` when it is empty: the common case,
        known without a look for a span or baggage in it) and whether its span was
        sampled (None: it holds none)."""
        if not self.context.get_current():
            return self.empty, None
        return None, self.sampled(None)

    def sampled(self, context: Any) -> bool | None:
        """Whether ``context`` (None: the current one) holds a sampled span context; None:
        it holds no valid one (a span under it starts a trace)."""
        span = self.trace.get_current_span(context).get_span_context()
        return bool(span.trace_flags.sampled) if span.is_valid else None

    def inject(self, props: MutableMapping[str, str], context: Any = None) -> None:
        """``propagate.inject(props, context)``: write the context into the properties."""
        span = self.trace.get_current_span(context).get_span_context()
        if span.is_valid and self.w3c() and not self.baggage.get_all(context):
            self._write(props, span.trace_id, span.span_id, span.trace_flags, span.trace_state)
        else:
            self.propagate.inject(props, context=context)

    def inject_span(self, props: MutableMapping[str, str], span: Span, context: Any = None) -> None:
        """Write a span that was never built — ``span``: (trace id, span id, flags, trace
        state or None) — into the properties, as a child of ``context`` would be (None: the
        current context: its baggage goes too)."""
        if self.w3c() and (context is self.empty or not self.baggage.get_all(context)):
            self._write(props, *span)
        else:
            self.propagate.inject(props, context=self.context_of(span, context))

    def context_of(self, span: Span, context: Any = None) -> Any:
        """``context`` (None: the current one) with the never-built ``span`` current in it."""
        trace = self.trace
        trace_id, span_id, flags, state = span
        built = trace.SpanContext(trace_id, span_id, False, trace.TraceFlags(flags), state)
        return trace.set_span_in_context(trace.NonRecordingSpan(built), context)

    @staticmethod
    def _write(
        props: MutableMapping[str, str], trace_id: int, span_id: int, flags: int, state: Any
    ) -> None:
        # %-formatting: a third faster than the f-string here, on every traced send
        props["traceparent"] = "00-%032x-%016x-%02x" % (trace_id, span_id, flags)  # noqa: UP031
        if state:
            props["tracestate"] = state.to_header()


#: a W3C ``traceparent`` of version 00 (lowercase hex); anything else is left to the propagator
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
#: all-zero ids (invalid: the propagator reads no span from them)
_NO_TRACE, _NO_SPAN = "0" * 32, "0" * 16
#: the flags' low hex digit of an unsampled span
_UNSAMPLED = frozenset("02468ace")


def _span_context(trace: Any, found: re.Match[str]) -> Any:
    """The remote span context of a matched ``traceparent``."""
    flags = trace.TraceFlags(int(found[3], 16))
    return trace.SpanContext(int(found[1], 16), int(found[2], 16), True, flags)


def _carried_span_type(trace: Any) -> Any:
    """The span a consumer makes current for a carried, unsampled ``traceparent``: a
    ``NonRecordingSpan`` whose span context is built when first asked for (by a span
    started under it, or a send that carries it on).  Most listeners ask for none; building
    it at once (two hex ids to ints, a SpanContext and its TraceFlags) made reading the
    ``traceparent`` 2.1 µs instead of 1.2, of a consumed message's ~16.  (Made once, by
    :class:`Otel`: the API is imported there.)"""

    class Carried(trace.NonRecordingSpan):  # type: ignore[misc]
        def __init__(self, found: re.Match[str]) -> None:
            self._found = found
            self._context = None

        def get_span_context(self) -> Any:
            context = self._context
            if context is None:
                context = self._context = _span_context(trace, self._found)
            return context

        def __repr__(self) -> str:
            return f"NonRecordingSpan({self.get_span_context()!r})"

    return Carried


class _Drawn:
    """A tracer's id generator, except that a root's trace id drawn (and judged) ahead of
    its span is the one the tracer gets next, on the thread that drew it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ahead = threading.local()

    def generate_trace_id(self) -> int:
        trace_id: int = getattr(self.ahead, "trace_id", 0)
        if trace_id:
            self.ahead.trace_id = 0
            return trace_id
        drawn: int = self.inner.generate_trace_id()
        return drawn

    def generate_span_id(self) -> int:
        drawn: int = self.inner.generate_span_id()
        return drawn

    def is_trace_id_random(self) -> bool:
        random = getattr(self.inner, "is_trace_id_random", None)
        return bool(random()) if random is not None else False


#: W3C trace-context level 2's flag: the trace id's low 56 bits are random
_RANDOM_TRACE_ID = 0x02


class Roots:
    """Roots a ratio sampler drops, answered without a span (see the module
    documentation)."""

    def __init__(self, ids: _Drawn, bound: int) -> None:
        self.ids = ids
        #: the root verdict: the trace id's low 64 bits below this bound
        self.bound = bound
        self.random = _RANDOM_TRACE_ID if ids.is_trace_id_random() else 0

    @classmethod
    def of(cls, tracer: Any) -> Roots | None:
        """The fast path for an SDK tracer (its ``sampler`` and ``id_generator``) whose
        sampler judges a root by its trace id alone (``TraceIdRatioBased``, alone or as
        ``ParentBased``'s root); None for any other, whose verdict only the sampler can
        give (asked twice, one that is not a function of the trace id would answer twice),
        or when the SDK counts its spans in metrics of its own
        (``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED``): then every span goes through it."""
        sampler = getattr(tracer, "sampler", None)
        ids = getattr(tracer, "id_generator", None)
        if sampler is None or ids is None:
            return None
        if os.environ.get("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "").lower() == "true":
            return None
        try:
            bound = _ratio_bound(sampler)
        except ImportError:
            return None
        if bound is None:
            return None
        if not isinstance(ids, _Drawn):
            ids = _Drawn(ids)
            tracer.id_generator = ids
        return cls(ids, bound)

    def judge(self) -> Span | None:
        """A root span (under a context holding no valid span) as (trace id, span id,
        flags, None) when the sampler drops it; None: it is kept — start it, and it gets
        the trace id judged here."""
        ids = self.ids
        trace_id = ids.inner.generate_trace_id()
        if trace_id & _LOW_64 < self.bound:
            ids.ahead.trace_id = trace_id
            return None
        return trace_id, ids.inner.generate_span_id(), self.random, None


_LOW_64 = (1 << 64) - 1
_RATIO = re.compile(r"(?:ParentBased\{root:)?TraceIdRatioBased\{([^}]+)\}.*")


def _ratio_bound(sampler: Any) -> int | None:
    """The bound of the SDK's ``TraceIdRatioBased`` (alone or as ``ParentBased``'s root),
    whose verdict on a root depends on the trace id alone; None for any other sampler, or
    when a check of trace ids on either side of the bound does not agree with the sampler
    (a version of the SDK that judges otherwise)."""
    from opentelemetry.sdk.trace import sampling

    if type(sampler) not in (sampling.ParentBased, sampling.TraceIdRatioBased):
        if type(sampler) is not getattr(sampling, "ParentBasedTraceIdRatio", None):
            return None
    found = _RATIO.fullmatch(sampler.get_description())
    if found is None:
        return None
    try:
        bound = sampling.TraceIdRatioBased.get_bound_for_rate(float(found[1]))
    except (TypeError, ValueError):
        return None
    high = 0x5A5A << 80
    for trace_id in (
        1,
        bound - 1,
        bound,
        bound + 1,
        _LOW_64,
        high | 1,
        high | bound,
        high | bound - 1,
    ):
        if not 0 < trace_id < 1 << 128:
            continue
        verdict = sampler.should_sample(None, trace_id, "root", None, None, ())
        if verdict.decision.is_sampled() != (trace_id & _LOW_64 < bound):
            return None
    return int(bound)


@dataclass(frozen=True, slots=True)
class Active:
    """The tracer txmq traces with, and its fast path for dropped roots (None: none)."""

    api: Otel
    tracer: Any
    roots: Roots | None


_otel: Otel | None = None
_otel_missing = False
_provider: Any = None
_active: tuple[Any, Active] | None = None


def use_tracer_provider(provider: Any) -> None:
    """Trace with ``provider`` (an OpenTelemetry ``TracerProvider``) instead of the global
    one; ``None``: the global one again (``opentelemetry.trace.set_tracer_provider``)."""
    global _provider, _active
    _provider, _active = provider, None


def api() -> Otel | None:
    """The OpenTelemetry API, or None when it is not installed."""
    global _otel, _otel_missing
    if _otel is None and not _otel_missing:
        try:
            _otel = Otel()
        except ImportError:
            _otel_missing = True
    return _otel


def tracer_provider() -> Any:
    """The tracer provider txmq traces with (the one given to :func:`use_tracer_provider`,
    else the global one), or None when there is none (or no OpenTelemetry API): for an
    application's own spans beside txmq's."""
    otel = _otel if _otel is not None else api()
    if otel is None:
        return None
    provider = _provider
    if provider is None:
        # the global provider as set_tracer_provider left it (what get_tracer_provider
        # answers, without its look at os.environ on every call while none is set)
        provider = otel.trace._TRACER_PROVIDER
        if provider is None:
            if not otel.from_env:
                return None
            provider = otel.trace.get_tracer_provider()
    return None if isinstance(provider, otel.inactive) else provider


def active() -> Active | None:
    """txmq's tracer and its fast path, or None when nothing would record its spans."""
    global _active
    provider = tracer_provider()
    if provider is None:
        return None
    made = _active
    if made is not None and made[0] is provider:
        return made[1]
    otel = _otel
    assert otel is not None  # tracer_provider() found a provider through it
    traced = provider.get_tracer("txmq", _version())
    found = Active(otel, traced, Roots.of(traced))
    _active = (provider, found)
    return found


def tracer() -> Any:
    """txmq's OpenTelemetry tracer, or None when nothing would record its spans (the API is
    not installed, or no tracer provider is configured)."""
    found = active()
    return None if found is None else found.tracer


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("txmq")
    except PackageNotFoundError:
        return None
