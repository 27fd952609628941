"""The scheduler's spans, metrics and stats log: per request (on its record), per step,
and the periodic stats line and block audit.

    trace of one request (its context arrives in AddRequest.trace_context)
    scheduler.request
    ├── scheduler.queue       arrival → first scheduled step
    └── scheduler.prefill     first scheduled step → first token
        └── worker.prefill    (context sent in NewRequestData.trace_context)

Steps live in traces of their own (scheduler.step → worker.step), linked to the
requests they carry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from opentelemetry import trace

from llmserve.contract.outputs import RequestOutput
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.telemetry import SchedulerMetrics, step_phases, tracing

logger = logging.getLogger(__name__)


class RequestSpans:
    """One request's spans and queue time; it lives on the record (request.stream.spans)."""

    def __init__(self, request_id: str, trace_context: Mapping[str, str], prompt_tokens: int, n: int):
        """Opens scheduler.request (under the router's span) and scheduler.queue."""
        self.arrival = time.perf_counter()
        self.request = tracing.start_span(
            "scheduler.request", parent=tracing.context_from_map(trace_context),
            attributes={"llmserve.request_id": request_id, "llmserve.prompt_tokens": prompt_tokens, "llmserve.n": n})
        self.queue = tracing.start_span("scheduler.queue", parent=self.request)
        self.prefill: trace.Span | None = None

    def scheduled(self, metrics: SchedulerMetrics) -> None:
        """In a step about to run: the first time ends its queue wait."""
        if self.prefill is not None:
            return
        metrics.queue_time.record(time.perf_counter() - self.arrival)
        self.queue.end()
        self.prefill = tracing.start_span("scheduler.prefill", parent=self.request)

    def produced(self) -> None:
        """A token came out: the prefill (however many steps it took) is over."""
        if self.prefill is not None and self.prefill.is_recording():
            self.prefill.end()

    def finished(self, finish_reason: str, error: str = "") -> None:
        for span in (self.queue, self.prefill):
            if span is not None and span.is_recording():
                span.end()
        self.request.set_attribute("llmserve.finish_reason", finish_reason)
        if error:
            self.request.set_status(trace.Status(trace.StatusCode.ERROR, error))
        self.request.end()

    def prefill_context(self) -> dict[str, str]:
        """Trace context for the worker's span of this request's prefill."""
        if not tracing.enabled():
            return {}
        return tracing.context_to_map(self.prefill or self.request)


class SchedulerTelemetry:
    """The service's metrics and spans: requests' (on their records) and steps'."""

    def __init__(self, metrics: SchedulerMetrics):
        self.metrics = metrics
        # Per-phase host time for `llmserve bench overhead` (the loop, the worker link and
        # the router hub time their parts); a no-op unless its variable is set.
        step_phases.start("scheduler")

    def request_added(self, request: Request, trace_context: Mapping[str, str], prompt_tokens: int, n: int) -> None:
        request.stream.spans = RequestSpans(request.request_id, trace_context, prompt_tokens, n)

    def output(self, request: Request, out: RequestOutput) -> None:
        """An output of `request` on its way to its router."""
        spans = request.stream.spans
        if spans is None:
            return
        if out.new_token_ids:
            spans.produced()
        if out.finished and request.is_finished:  # Its last sample's end (n > 1: the first of them).
            spans.finished(out.finish_reason.name.lower(), out.error)
            request.stream.spans = None

    def close_all(self, core: Scheduler | None, reason: str) -> None:
        """Shutdown: ends the spans of the requests still in the core."""
        for request in core.unfinished_requests() if core is not None else ():
            if request.stream.spans is not None:
                request.stream.spans.finished("abort", reason)
                request.stream.spans = None

    def step_started(self, core: Scheduler, plan: StepPlan, start_ns: int):
        """The step's span (linked to its requests); puts trace contexts into the plan."""
        # NOTE: a request's first scheduled step sends it in full (a new request): only
        # those can end a queue wait, so the cached rows are not looked at (tracing off).
        new_spans = self._spans(core, plan.new_requests)
        for request_spans in new_spans:
            if request_spans is not None:
                request_spans.scheduled(self.metrics)
        if not tracing.enabled():
            return tracing.trace.INVALID_SPAN
        rows = plan.new_requests + plan.cached_requests
        spans = new_spans + self._spans(core, plan.cached_requests)
        prefill = sum(r.num_scheduled_tokens for r in plan.new_requests)
        links = [link for s in dict.fromkeys(s for s in spans if s is not None)
                 if (link := tracing.link_to(s.request)) is not None]
        # NOTE: the span starts where the step did, before schedule(), as the step time metric does.
        span = tracing.start_span("scheduler.step", parent=tracing.otel_context.Context(), start_time=start_ns,
                                  links=links, attributes={
            "llmserve.step_id": plan.step_id,
            "llmserve.batch_size": len(rows),
            "llmserve.num_new_requests": len(plan.new_requests),
            "llmserve.num_scheduled_tokens": plan.total_scheduled_tokens,
            "llmserve.num_new_request_tokens": prefill,
            "llmserve.num_swap_out": len(plan.swap_out), "llmserve.num_swap_in": len(plan.swap_in)})
        plan.trace_context = tracing.context_to_map(span)
        for r, request_spans in zip(plan.new_requests, spans):
            r.trace_context = request_spans.prefill_context() if request_spans is not None else {}
        return span

    @staticmethod
    def _spans(core: Scheduler, rows) -> list[RequestSpans | None]:
        """The spans of each row's request (None: no longer live, or without spans)."""
        samples = [core.get_sample(r.seq_id) for r in rows]
        return [s.request.stream.spans if s is not None else None for s in samples]

    def step_finished(self, core: Scheduler, plan: StepPlan, result: StepResult, span, seconds: float) -> None:
        if result.error:
            span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, result.error))
        span.end()
        self.metrics.step_time.record(seconds)
        self.metrics.step_tokens.record(plan.total_scheduled_tokens * result.num_steps)
        self.metrics.stats = core.stats()

    async def audit_blocks_forever(self, core_of: Callable[[], Scheduler | None], interval_s: float = 5.0) -> None:
        """Feeds the orphaned-blocks gauge; a leak is logged with what the audit found."""
        reported = False
        while True:
            await asyncio.sleep(interval_s)
            core = core_of()
            if core is None:
                continue
            audit = core.unbalanced_audit()  # None (the common case) without walking every block
            self.metrics.orphaned_blocks = 0 if audit is None else audit.num_orphaned_blocks
            if audit is not None and not audit.ok and not reported:
                logger.error("KV block audit: %s", "; ".join(audit.problems[:10]))
            reported = audit is not None and not audit.ok

    @staticmethod
    async def log_stats_forever(core_of: Callable[[], Scheduler | None], interval_s: float) -> None:
        """A queue / KV-usage line every `interval_s` while requests are in flight."""
        while True:
            await asyncio.sleep(interval_s)
            core = core_of()
            if core is not None and core.has_unfinished_requests():
                log_stats(core)


def log_stats(core: Scheduler) -> None:
    s = core.stats()
    logger.info(
        "running: %d, waiting: %d, swapped: %d, KV cache usage: %.1f%%, CPU swap usage:"
        " %.1f%%, prefix cache hit rate: %.1f%%, preemptions: %d recompute / %d swap,"
        " swapped-out blocks: %d, cached blocks: %d, queued: %d requests / %d tokens, refused: %d,"
        " expired: %d",
        s.num_running, s.num_waiting, s.num_swapped, 100 * s.kv_cache_usage,
        100 * (1 - s.num_free_cpu_blocks / s.num_cpu_blocks) if s.num_cpu_blocks else 0.0,
        100 * s.prefix_cache_hit_rate, s.num_preemptions_recompute, s.num_preemptions_swap,
        s.num_swapped_out_blocks, s.num_cached_blocks, s.num_queued_requests, s.num_queued_tokens,
        sum(s.num_refused.values()), s.num_expired,
    )
    if s.spec_num_drafts:
        logger.info("speculative decoding: %d drafted steps, %d of %d draft tokens accepted (%.1f%%), "
                    "mean accepted length %.2f, accepted by position %s",
                    s.spec_num_drafts, s.spec_num_accepted_tokens, s.spec_num_draft_tokens,
                    100 * s.spec_acceptance_rate, s.spec_mean_accepted_length,
                    list(s.spec_accepted_per_position))
