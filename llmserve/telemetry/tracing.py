"""Tracing: an OpenTelemetry TracerProvider configured from the standard OTEL_* variables,
W3C trace-context carried in gRPC metadata and in internal protobuf maps, span helpers.

Off (the default: OTEL_TRACES_EXPORTER unset or "none") nothing is installed, and every
helper here returns at once: `start_span` hands back the shared non-recording span, the
context maps are empty.

    OTEL_TRACES_EXPORTER=otlp|console|none (comma-separated list)
    OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL=grpc (default) | http/protobuf
    OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, ...
    LLMSERVE_SPAN_FILE=path        also append every finished span as a JSON line to that
                                   file (no collector needed; several processes may share
                                   it). LLMSERVE_TEST_SPAN_FILE, its former name, still works.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

logger = logging.getLogger(__name__)

SPAN_FILE_ENV = "LLMSERVE_SPAN_FILE"
OLD_SPAN_FILE_ENV = "LLMSERVE_TEST_SPAN_FILE"  # Its name until the file served more than tests.
TRACER_NAME = "llmserve"

_provider = None  # The SDK TracerProvider once set up; None while tracing is off.
_tracer: trace.Tracer | None = None


def enabled() -> bool:
    return _tracer is not None


def _otlp_exporter():
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    return OTLPSpanExporter()  # Endpoint, headers, timeout, TLS: from OTEL_EXPORTER_OTLP_*.


def span_file_path() -> str | None:
    """The JSON-lines span file the environment asks for, if any."""
    return os.environ.get(SPAN_FILE_ENV) or os.environ.get(OLD_SPAN_FILE_ENV) or None


def exporter_names() -> list[str]:
    """The exporters OTEL_TRACES_EXPORTER asks for ([] = tracing off)."""
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",")]
    return [n for n in names if n and n != "none"]


def setup_tracing(service_name: str) -> bool:
    """Installs the SDK tracer provider when the environment asks for traces. Returns
    whether tracing is on. Call once per process, before serving."""
    global _provider, _tracer
    names, span_file = exporter_names(), span_file_path()
    if not names and not span_file:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in names:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console, none)")
    if span_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(span_file)))
    trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer(TRACER_NAME)
    logger.info("tracing on: service %s, exporters %s%s", provider.resource.attributes.get(SERVICE_NAME),
                names or ["-"], f", span file {span_file}" if span_file else "")
    return True


def shutdown_tracing() -> None:
    """Flushes and stops the exporters (at service exit)."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


# --- spans ---------------------------------------------------------------------------


def start_span(name: str, *, parent: otel_context.Context | trace.Span | None = None,
               kind: trace.SpanKind = trace.SpanKind.INTERNAL, attributes: Mapping | None = None,
               links: Sequence[trace.Link] | None = None, start_time: int | None = None) -> trace.Span:
    """A started span (end it yourself); the non-recording INVALID_SPAN while tracing is off.
    `parent`: a context, a span, or None for the current context."""
    if _tracer is None:
        return trace.INVALID_SPAN
    if isinstance(parent, trace.Span):
        parent = trace.set_span_in_context(parent)
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes, links=links,
                              start_time=start_time)


@contextlib.contextmanager
def span(name: str, **kwargs) -> Iterator[trace.Span]:
    """`with span("tokenize") as s:` a span ended on exit (and made current inside)."""
    if _tracer is None:
        yield trace.INVALID_SPAN
        return
    s = start_span(name, **kwargs)
    with trace.use_span(s, end_on_exit=True):
        yield s


def link_to(span_: trace.Span, attributes: Mapping | None = None) -> trace.Link | None:
    ctx = span_.get_span_context()
    return trace.Link(ctx, attributes) if ctx.is_valid else None


# --- propagation (W3C traceparent / tracestate) ------------------------------------


def context_to_map(parent: trace.Span | otel_context.Context | None = None) -> dict[str, str]:
    """The trace context (of a span, a context, or the current one) as text pairs, for an
    internal message's `trace_context` map or gRPC metadata; {} while tracing is off."""
    if _tracer is None:
        return {}
    if isinstance(parent, trace.Span):
        parent = trace.set_span_in_context(parent)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=parent)
    return carrier


def context_from_map(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The remote parent context carried in `carrier`; None when off or absent."""
    if _tracer is None or not carrier:
        return None
    return propagate.extract(dict(carrier))


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context | None:
    """The parent context from gRPC invocation metadata (a client's `traceparent`)."""
    if _tracer is None or not metadata:
        return None
    carrier = {k.lower(): v for k, v in metadata if isinstance(v, str)}
    return propagate.extract(carrier) if "traceparent" in carrier else None


def metadata_with_context(parent: trace.Span | otel_context.Context | None = None,
                          metadata: Sequence[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying the trace context (client side of a call)."""
    pairs = tuple(metadata) + tuple(context_to_map(parent).items())
    return pairs or None


# --- the JSON-lines file exporter (LLMSERVE_SPAN_FILE: tests, debugging, benchmarks) -


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_to_dict(s) -> dict:
    """A finished SDK span as plain JSON-able data."""
    ctx, parent = s.context, s.parent
    return {
        "name": s.name,
        "service": s.resource.attributes.get("service.name"),
        "trace_id": _hex(ctx.trace_id, 32),
        "span_id": _hex(ctx.span_id, 16),
        "parent_span_id": _hex(parent.span_id, 16) if parent is not None else None,
        "kind": s.kind.name,
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "attributes": dict(s.attributes or {}),
        "links": [{"trace_id": _hex(l.context.trace_id, 32), "span_id": _hex(l.context.span_id, 16),
                   "attributes": dict(l.attributes or {})} for l in s.links],
        "status": s.status.status_code.name,
    }


class JsonLinesSpanExporter:
    """A SpanExporter appending one JSON object a line to `path` (several processes may share
    the file: each line is one write in append mode)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans).encode()
        with self._lock:  # One O_APPEND write: lines from several processes never interleave.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
