"""Observability shared by the three services: OpenTelemetry tracing (W3C trace context
across router → scheduler → worker) and metrics on a Prometheus endpoint per service."""

from llmserve.telemetry.metrics import (
    METRICS,
    RouterMetrics,
    SchedulerMetrics,
    WorkerMetrics,
    setup_metrics,
    shutdown_metrics,
)
from llmserve.telemetry.tracing import (
    context_from_map,
    context_from_metadata,
    context_to_map,
    enabled,
    metadata_with_context,
    setup_tracing,
    shutdown_tracing,
    span,
    start_span,
)

__all__ = [
    "METRICS", "RouterMetrics", "SchedulerMetrics", "WorkerMetrics", "setup_metrics", "shutdown_metrics",
    "context_from_map", "context_from_metadata", "context_to_map", "enabled", "metadata_with_context",
    "setup_tracing", "shutdown_tracing", "span", "start_span",
]
