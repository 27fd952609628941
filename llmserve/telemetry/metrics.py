"""Metrics: OpenTelemetry instruments exported on a Prometheus scrape endpoint per service.

`--metrics-port 0` (the default) installs nothing: the instruments come from the API's
no-op meter and cost a method call. Every metric is declared once in METRICS below; the
README table and the tests read the same list.

Every sample carries `model_name` (the served model's name, as vLLM's metrics do), so
one Prometheus scraping several deployments can tell their models apart. The services'
metrics classes add it to every record and observation (`ModelLabel`): no call site
passes it, and none can forget it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import NoOpMeter, Observation

from llmserve.contract.startup_errors import port_error

logger = logging.getLogger(__name__)

METER_NAME = "llmserve"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0, 160.0, 320.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                     0.75, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # OpenTelemetry instrument name.
    kind: str  # counter | histogram | gauge (observable) | observable_counter
    service: str  # router | scheduler | worker
    description: str
    unit: str = ""  # "s" -> Prometheus suffix _seconds
    buckets: tuple[float, ...] | None = None
    labels: tuple[str, ...] = ()  # Besides COMMON_LABELS, which every metric has.

    @property
    def all_labels(self) -> tuple[str, ...]:
        return COMMON_LABELS + self.labels

    @property
    def prometheus_name(self) -> str:
        """The name the Prometheus endpoint serves (without _bucket/_sum/_count)."""
        name = self.name.replace(".", "_")
        if self.unit == "s":
            name += "_seconds"
        if self.kind in ("counter", "observable_counter"):
            name += "_total"
        return name


COMMON_LABELS = ("model_name",)

METRICS: tuple[MetricSpec, ...] = (
    # router: per request, as the client sees it
    MetricSpec("llmserve.time_to_first_token", "histogram", "router",
               "request arrival at the router to its first token out", "s", LATENCY_BUCKETS),
    MetricSpec("llmserve.time_per_output_token", "histogram", "router",
               "mean gap between a request's output tokens after the first", "s", PER_TOKEN_BUCKETS),
    MetricSpec("llmserve.e2e_request_latency", "histogram", "router",
               "request arrival to its last token", "s", LATENCY_BUCKETS, ("finish_reason",)),
    MetricSpec("llmserve.prompt_tokens", "counter", "router", "prompt tokens of admitted requests"),
    MetricSpec("llmserve.generation_tokens", "counter", "router", "tokens streamed to clients"),
    MetricSpec("llmserve.requests", "counter", "router", "finished requests",
               labels=("finish_reason",)),
    MetricSpec("llmserve.routed_requests", "counter", "router",
               "requests placed on a data-parallel replica (a migrated request counts again)",
               labels=("replica", "policy")),
    MetricSpec("llmserve.routed_cached_tokens", "counter", "router",
               "prompt tokens the chosen replica was expected to hold in its prefix cache when the request was "
               "placed (from its KV events)", labels=("replica",)),
    MetricSpec("llmserve.migrated_requests", "counter", "router",
               "requests moved to another replica after theirs failed mid-stream (resumed from their tokens so "
               "far)"),
    # scheduler: queues, KV cache, steps
    MetricSpec("llmserve.queue_time", "histogram", "scheduler",
               "request arrival at the scheduler to its first scheduled step", "s", LATENCY_BUCKETS),
    MetricSpec("llmserve.num_requests_running", "gauge", "scheduler", "sequences running"),
    MetricSpec("llmserve.num_requests_waiting", "gauge", "scheduler", "sequences waiting"),
    MetricSpec("llmserve.num_requests_swapped", "gauge", "scheduler", "sequences swapped out to CPU"),
    MetricSpec("llmserve.kv_cache_usage", "gauge", "scheduler", "fraction of KV blocks in use (0..1)"),
    MetricSpec("llmserve.prefix_cache_hit_rate", "gauge", "scheduler",
               "prefix-cache hit tokens / queried tokens since start (0..1)"),
    MetricSpec("llmserve.prefix_cache_queries", "observable_counter", "scheduler",
               "prompt tokens looked up in the prefix cache"),
    MetricSpec("llmserve.prefix_cache_hits", "observable_counter", "scheduler",
               "prompt tokens found in the prefix cache"),
    MetricSpec("llmserve.preemptions", "observable_counter", "scheduler",
               "preemptions when KV blocks ran out", labels=("mode",)),
    MetricSpec("llmserve.spec_decode_num_drafts", "observable_counter", "scheduler",
               "speculative decoding: sequence-steps that carried n-gram drafts"),
    MetricSpec("llmserve.spec_decode_num_draft_tokens", "observable_counter", "scheduler",
               "speculative decoding: draft tokens verified"),
    MetricSpec("llmserve.spec_decode_num_accepted_tokens", "observable_counter", "scheduler",
               "speculative decoding: draft tokens kept (acceptance rate = this / draft tokens)"),
    MetricSpec("llmserve.spec_decode_num_accepted_tokens_per_pos", "observable_counter", "scheduler",
               "speculative decoding: drafts whose token at `position` (0-based) was kept", labels=("position",)),
    MetricSpec("llmserve.orphaned_kv_blocks", "gauge", "scheduler",
               "KV blocks held for requests that no longer exist, from the periodic block audit (must stay 0)"),
    MetricSpec("llmserve.step_time", "histogram", "scheduler",
               "one engine step: plan, worker round trip, output update (a multi-step plan: all its steps)",
               "s", PER_TOKEN_BUCKETS),
    MetricSpec("llmserve.step_tokens", "histogram", "scheduler", "tokens computed in one step (or multi-step plan)",
               buckets=TOKEN_BUCKETS),
    # scheduler: admission control and deadlines
    MetricSpec("llmserve.queued_requests", "gauge", "scheduler",
               "requests queued: waiting or swapped out, none of their samples running"),
    MetricSpec("llmserve.queued_requests_limit", "gauge", "scheduler",
               "--max-queued-requests (or its default): new requests are refused when more wait than this "
               "plus the free seats"),
    MetricSpec("llmserve.queued_tokens", "gauge", "scheduler",
               "tokens the queued requests must compute before their next token (prompts)"),
    MetricSpec("llmserve.queued_tokens_limit", "gauge", "scheduler",
               "--max-queued-tokens (or its default): new requests are refused beyond it"),
    MetricSpec("llmserve.saturated", "gauge", "scheduler",
               "1 from a refusal until the queue drains to half its bounds (the router's "
               "llmserve.v1.Generation health is NOT_SERVING meanwhile), else 0"),
    MetricSpec("llmserve.requests_refused", "observable_counter", "scheduler",
               "requests refused with RESOURCE_EXHAUSTED by the queue bounds: queued_requests, queued_tokens "
               "(at arrival), displaced (queued, pushed out by better priority)", labels=("reason",)),
    MetricSpec("llmserve.requests_expired", "observable_counter", "scheduler",
               "requests ended by their deadline (DEADLINE_EXCEEDED), queued or running"),
    # worker
    MetricSpec("llmserve.worker_step_time", "histogram", "worker",
               "one plan on the worker (block moves, forward and sampling, once per step it runs)", "s",
               PER_TOKEN_BUCKETS),
)
SPECS = {spec.name: spec for spec in METRICS}

_started: dict[str, object] = {}  # One endpoint per process.


def setup_metrics(service: str, port: int, host: str = "127.0.0.1"):
    """Starts the Prometheus endpoint for `service` on `host:port` (services pass their own
    --host: metrics bind like the service) and returns its meter;
    port 0 returns the no-op meter (nothing installed)."""
    if not port:
        return NoOpMeter(METER_NAME)
    if "meter" in _started:
        return _started["meter"]
    import prometheus_client
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    views = [View(instrument_name=s.name, aggregation=ExplicitBucketHistogramAggregation(list(s.buckets)))
             for s in METRICS if s.buckets]
    reader = PrometheusMetricReader(scope_info_enabled=False)
    provider = MeterProvider(metric_readers=[reader], views=views,
                             resource=Resource.create({SERVICE_NAME: f"llmserve-{service}"}))
    try:
        server, thread = prometheus_client.start_http_server(port, addr=host)
    except OSError as err:
        raise port_error("metrics", host, port, "--metrics-port", err) from err
    otel_metrics.set_meter_provider(provider)
    _started.update(meter=provider.get_meter(METER_NAME), provider=provider, server=server, thread=thread)
    logger.info("metrics: Prometheus endpoint on http://%s:%d/metrics", host, port)
    return _started["meter"]


def shutdown_metrics() -> None:
    server = _started.pop("server", None)
    if server is not None:
        server.shutdown()
        server.server_close()
    provider = _started.pop("provider", None)
    if provider is not None:
        provider.shutdown()
    _started.clear()


class ModelLabel:
    """The `model_name` label of one service's metrics. The router and the worker know their
    model at start-up; the scheduler learns it when a worker registers (until then it has
    run no step, so it has recorded nothing)."""

    def __init__(self, model_name: str = ""):
        self.model_name = model_name

    def labels(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"model_name": self.model_name, **(extra or {})}


class _Labelled:
    """An instrument whose every add / record carries the model label."""

    def __init__(self, instrument, label: ModelLabel):
        self._instrument, self._label = instrument, label

    def add(self, amount, attributes: dict[str, str] | None = None) -> None:
        self._instrument.add(amount, self._label.labels(attributes))

    def record(self, amount, attributes: dict[str, str] | None = None) -> None:
        self._instrument.record(amount, self._label.labels(attributes))


def _instrument(meter, name: str, label: ModelLabel, callbacks: list[Callable] | None = None):
    """The instrument for METRICS[name]; an observable one's callbacks get the model label
    added to each of their observations."""
    spec = SPECS[name]
    if spec.kind == "counter":
        return _Labelled(meter.create_counter(name, unit=spec.unit, description=spec.description), label)
    if spec.kind == "histogram":
        return _Labelled(meter.create_histogram(name, unit=spec.unit, description=spec.description), label)
    labelled = [_labelling(callback, label) for callback in callbacks or []]
    if spec.kind == "gauge":
        return meter.create_observable_gauge(name, labelled, unit=spec.unit, description=spec.description)
    return meter.create_observable_counter(name, labelled, unit=spec.unit, description=spec.description)


def _labelling(callback: Callable, label: ModelLabel) -> Callable:
    def observe(options):
        return [Observation(o.value, label.labels(dict(o.attributes or {}))) for o in callback(options)]
    return observe


class ModelNamed:
    """A service's metrics whose `model_name` label can be set once the model is known."""

    label: ModelLabel

    @property
    def model_name(self) -> str:
        return self.label.model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        self.label.model_name = name


class RouterMetrics:
    def __init__(self, meter, model_name: str = ""):
        self.label = ModelLabel(model_name)
        self.ttft = _instrument(meter, "llmserve.time_to_first_token", self.label)
        self.tpot = _instrument(meter, "llmserve.time_per_output_token", self.label)
        self.e2e = _instrument(meter, "llmserve.e2e_request_latency", self.label)
        self.prompt_tokens = _instrument(meter, "llmserve.prompt_tokens", self.label)
        self.generation_tokens = _instrument(meter, "llmserve.generation_tokens", self.label)
        self.requests = _instrument(meter, "llmserve.requests", self.label)
        self.routed = _instrument(meter, "llmserve.routed_requests", self.label)
        self.routed_cached_tokens = _instrument(meter, "llmserve.routed_cached_tokens", self.label)
        self.migrations = _instrument(meter, "llmserve.migrated_requests", self.label)
        for counter in (self.prompt_tokens, self.generation_tokens, self.migrations):
            counter.add(0)  # Served as 0 from the start, not only after the first request.

    def request_routed(self, replica: str, policy: str, expected_cached_tokens: int) -> None:
        self.routed.add(1, {"replica": replica, "policy": policy})
        self.routed_cached_tokens.add(expected_cached_tokens, {"replica": replica})

    def request_finished(self, arrival: float, first_token: float | None, num_tokens: int,
                         finish_reason: str) -> None:
        """Records one request's latencies (perf_counter times) and its outcome."""
        now = time.perf_counter()
        labels = {"finish_reason": finish_reason}
        self.e2e.record(now - arrival, labels)
        self.requests.add(1, labels)
        if first_token is not None and num_tokens > 1:
            self.tpot.record((now - first_token) / (num_tokens - 1))


class SchedulerMetrics(ModelNamed):
    """Histograms recorded as steps run; gauges read the last stats snapshot, which the
    engine loop replaces after every step (the scrape thread never touches the core)."""

    def __init__(self, meter):
        self.label = ModelLabel()  # Set by `model_name` when a worker registers.
        self.stats = None  # The latest SchedulerStats (or None before a worker registers).
        self.queue_time = _instrument(meter, "llmserve.queue_time", self.label)
        self.step_time = _instrument(meter, "llmserve.step_time", self.label)
        self.step_tokens = _instrument(meter, "llmserve.step_tokens", self.label)
        for name, attr in (("llmserve.num_requests_running", "num_running"),
                           ("llmserve.num_requests_waiting", "num_waiting"),
                           ("llmserve.num_requests_swapped", "num_swapped"),
                           ("llmserve.kv_cache_usage", "kv_cache_usage"),
                           ("llmserve.prefix_cache_hit_rate", "prefix_cache_hit_rate"),
                           ("llmserve.prefix_cache_queries", "prefix_cache_queries"),
                           ("llmserve.prefix_cache_hits", "prefix_cache_hits"),
                           ("llmserve.queued_requests", "num_queued_requests"),
                           ("llmserve.queued_requests_limit", "max_queued_requests"),
                           ("llmserve.queued_tokens", "num_queued_tokens"),
                           ("llmserve.queued_tokens_limit", "max_queued_tokens"),
                           ("llmserve.saturated", "saturated"),
                           ("llmserve.requests_expired", "num_expired"),
                           ("llmserve.spec_decode_num_drafts", "spec_num_drafts"),
                           ("llmserve.spec_decode_num_draft_tokens", "spec_num_draft_tokens"),
                           ("llmserve.spec_decode_num_accepted_tokens", "spec_num_accepted_tokens")):
            _instrument(meter, name, self.label, [self._observe(attr)])
        _instrument(meter, "llmserve.preemptions", self.label, [self._observe_preemptions])
        self.orphaned_blocks: int | None = None  # From the periodic block audit.
        _instrument(meter, "llmserve.orphaned_kv_blocks", self.label,
                    [lambda options: [] if self.orphaned_blocks is None else [Observation(self.orphaned_blocks)]])
        _instrument(meter, "llmserve.requests_refused", self.label, [self._observe_refused])
        _instrument(meter, "llmserve.spec_decode_num_accepted_tokens_per_pos", self.label,
                    [self._observe_accepted_per_position])

    def _observe(self, attr: str) -> Callable:
        def callback(options):
            stats = self.stats
            if stats is None:
                return []
            value = getattr(stats, attr)
            return [Observation(int(value) if isinstance(value, bool) else value)]
        return callback

    def _observe_refused(self, options):
        stats = self.stats
        if stats is None:
            return []
        return [Observation(count, {"reason": reason}) for reason, count in stats.num_refused.items()]

    def _observe_accepted_per_position(self, options):
        stats = self.stats
        if stats is None:
            return []
        return [Observation(count, {"position": str(i)}) for i, count in enumerate(stats.spec_accepted_per_position)]

    def _observe_preemptions(self, options):
        stats = self.stats
        if stats is None:
            return []
        return [Observation(stats.num_preemptions_recompute, {"mode": "recompute"}),
                Observation(stats.num_preemptions_swap, {"mode": "swap"})]


class WorkerMetrics(ModelNamed):
    def __init__(self, meter, model_name: str = ""):
        self.label = ModelLabel(model_name)  # The worker sets `model_name` once its model is loaded.
        self.step_time = _instrument(meter, "llmserve.worker_step_time", self.label)


def markdown_table() -> str:
    """The README's metrics table."""
    rows = ["| metric (Prometheus) | type | service | labels | meaning |", "|---|---|---|---|---|"]
    for s in METRICS:
        kind = {"observable_counter": "counter"}.get(s.kind, s.kind)
        rows.append(f"| `{s.prometheus_name}` | {kind} | {s.service} | {', '.join(s.all_labels)} "
                    f"| {s.description} |")
    return "\n".join(rows)
