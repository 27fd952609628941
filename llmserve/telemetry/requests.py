"""Per-request telemetry: the router's request span (with tokenize and detokenize
children) and metrics. The scheduler's queue / prefill spans of each request live on its
record (llmserve.scheduler.telemetry.RequestSpans).

    trace of one Generate call
    llmserve.generate (router, SERVER; parent = the client's traceparent if sent)
    ├── router.tokenize
    ├── scheduler.request                       (context sent in AddRequest.trace_context)
    │   ├── scheduler.queue                     arrival → first scheduled step
    │   └── scheduler.prefill                   first scheduled step → first token
    │       └── worker.prefill                  (context sent in NewRequestData.trace_context)
    └── router.detokenize                       first → last output (time spent in attributes)

Steps live in traces of their own (scheduler.step → worker.step), linked to the
requests they carry.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from llmserve.telemetry import tracing
from llmserve.telemetry.metrics import RouterMetrics


class RouterRequest:
    """One Generate call at the router: its span, TTFT, and the metrics at the end."""

    def __init__(self, metrics: RouterMetrics, metadata, model: str):
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.num_tokens = 0
        self.span = tracing.start_span(
            "llmserve.generate", parent=tracing.context_from_metadata(metadata), kind=trace.SpanKind.SERVER,
            attributes={"llmserve.model": model},
        )
        self._detok_span: trace.Span | None = None
        self._detok_seconds = 0.0
        self._detok_end_ns = 0

    def admitted(self, request_id: str, prompt_tokens: int) -> None:
        self.span.set_attribute("llmserve.request_id", request_id)
        self.span.set_attribute("llmserve.prompt_tokens", prompt_tokens)
        self.metrics.prompt_tokens.add(prompt_tokens)

    def routed(self, replica: str, policy: str, expected_cached_tokens: int, migrated: bool = False) -> None:
        """The replica chosen for this request (again, after a migration), and the prompt
        tokens it was expected to hold in its prefix cache."""
        self.span.add_event("router.routed", {"llmserve.replica": replica, "llmserve.routing_policy": policy,
                                              "llmserve.expected_cached_tokens": expected_cached_tokens,
                                              "llmserve.migrated": migrated})
        self.span.set_attribute("llmserve.replica", replica)
        self.span.set_attribute("llmserve.expected_cached_tokens", expected_cached_tokens)
        self.metrics.request_routed(replica, policy, expected_cached_tokens)
        if migrated:
            self.metrics.migrations.add(1)

    def trace_context(self) -> dict[str, str]:
        """What the scheduler needs to put its spans under this request's span."""
        return tracing.context_to_map(self.span)

    def tokenize_span(self):
        return tracing.span("router.tokenize", parent=self.span)

    def detokenizing(self) -> "_Detokenizing":
        return _Detokenizing(self)

    def tokens_out(self, num_tokens: int) -> None:
        if num_tokens and self.first_token is None:
            self.first_token = time.perf_counter()
            ttft = self.first_token - self.arrival
            self.metrics.ttft.record(ttft)
            self.span.set_attribute("llmserve.ttft_s", ttft)
        self.num_tokens += num_tokens
        self.metrics.generation_tokens.add(num_tokens)

    def finish(self, finish_reason: str, error: str = "") -> None:
        self.metrics.request_finished(self.arrival, self.first_token, self.num_tokens, finish_reason)
        if self._detok_span is not None:
            self._detok_span.set_attribute("llmserve.detokenize_s", self._detok_seconds)
            self._detok_span.end(end_time=self._detok_end_ns)
        s = self.span
        s.set_attribute("llmserve.completion_tokens", self.num_tokens)
        s.set_attribute("llmserve.finish_reason", finish_reason)
        if error:
            s.set_status(trace.Status(trace.StatusCode.ERROR, error))
        s.end()


class _Detokenizing:
    """Times one detokenization; the first opens the request's router.detokenize span."""

    def __init__(self, request: RouterRequest):
        self.request = request

    def __enter__(self):
        self.start = time.perf_counter()
        r = self.request
        if r._detok_span is None and tracing.enabled():
            r._detok_span = tracing.start_span("router.detokenize", parent=r.span)
        return self

    def __exit__(self, *exc):
        r = self.request
        r._detok_seconds += time.perf_counter() - self.start
        r._detok_end_ns = time.time_ns()
