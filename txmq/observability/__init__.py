"""Observability, shared by clients and servers: the client's metrics and traces
(:mod:`.hooks`: Prometheus and OpenTelemetry), histograms kept in plain numbers
(:mod:`.dist`) and how times, spans and tables read as text (:mod:`.fmt`)."""

from txmq.observability.hooks import use_registry, use_tracer_provider

__all__ = ["use_registry", "use_tracer_provider"]
