"""Fixtures for txmq.observability.hooks's tests: spans recorded by the OpenTelemetry SDK's
in-memory exporter, and a private Prometheus registry (import them into a test module by name)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from txmq.observability import hooks as observe

__all__ = ["recorded", "registry", "spans"]


@contextmanager
def recorded(sampler: Any = None) -> Iterator[InMemorySpanExporter]:
    """txmq's spans, recorded while the block runs (the provider is txmq's own: nothing
    global is set); ``sampler``: its sampler (default: the SDK's)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider() if sampler is None else TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observe.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        observe.use_tracer_provider(None)
        provider.shutdown()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """txmq's spans, recorded (see :func:`recorded`)."""
    with recorded() as exporter:
        yield exporter


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
