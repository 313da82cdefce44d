"""Fixtures for txmq.observability.hooks's tests: spans recorded by the OpenTelemetry SDK's
in-memory exporter, and a private Prometheus registry (import them into a test module by name)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from txmq.observability import hooks as observe

__all__ = ["registry", "spans"]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """txmq's spans, recorded (the provider is txmq's own: nothing global is set)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observe.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        observe.use_tracer_provider(None)
        provider.shutdown()


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """txmq's client metrics in a registry of their own."""
    before = observe._registry
    reg = CollectorRegistry()
    observe.use_registry(reg)
    try:
        yield reg
    finally:
        observe.use_registry(before)
