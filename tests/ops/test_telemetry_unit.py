"""The telemetry package alone: tracing from OTEL_* variables, W3C propagation through
text maps, the span file, the Prometheus names, and the cluster config file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmserve.telemetry import metrics, tracing

ROOT = Path(__file__).resolve().parents[2]


def test_tracing_is_off_without_exporters(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv(tracing.SPAN_FILE_ENV, raising=False)
    monkeypatch.delenv(tracing.OLD_SPAN_FILE_ENV, raising=False)
    assert tracing.exporter_names() == [] and tracing.span_file_path() is None
    assert not tracing.setup_tracing("llmserve-test")
    assert not tracing.enabled()
    assert tracing.start_span("x") is tracing.trace.INVALID_SPAN
    assert tracing.context_to_map() == {}
    assert tracing.context_from_map({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.exporter_names() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    assert tracing.exporter_names() == ["otlp", "console"]


def test_span_file_and_propagation(tmp_path):
    """In a fresh process: a client traceparent is honoured, a child crosses a text map."""
    span_file = tmp_path / "spans.jsonl"
    script = textwrap.dedent("""
        from llmserve.telemetry import tracing
        assert tracing.setup_tracing("svc-a")
        md = [("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]
        root = tracing.start_span("root", parent=tracing.context_from_metadata(md))
        carried = tracing.context_to_map(root)
        assert carried["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
        child = tracing.start_span("child", parent=tracing.context_from_map(carried),
                                   links=[tracing.link_to(root)])
        child.end(); root.end()
        tracing.shutdown_tracing()
    """)
    env = dict(os.environ, LLMSERVE_SPAN_FILE=str(span_file), OTEL_TRACES_EXPORTER="none")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
    spans = {s["name"]: s for s in map(json.loads, span_file.read_text().splitlines())}
    assert spans["root"]["trace_id"] == spans["child"]["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert spans["root"]["parent_span_id"] == "b7ad6b7169203331"
    assert spans["child"]["parent_span_id"] == spans["root"]["span_id"]
    assert spans["child"]["links"][0]["span_id"] == spans["root"]["span_id"]
    assert spans["root"]["service"] == "svc-a"


def test_span_file_keeps_its_former_name(monkeypatch, tmp_path):
    monkeypatch.delenv(tracing.SPAN_FILE_ENV, raising=False)
    monkeypatch.setenv(tracing.OLD_SPAN_FILE_ENV, str(tmp_path / "old.jsonl"))
    assert tracing.span_file_path() == str(tmp_path / "old.jsonl")
    monkeypatch.setenv(tracing.SPAN_FILE_ENV, str(tmp_path / "new.jsonl"))
    assert tracing.span_file_path() == str(tmp_path / "new.jsonl")


def test_prometheus_names_are_unique_and_documented():
    names = [s.prometheus_name for s in metrics.METRICS]
    assert len(names) == len(set(names))
    assert all(n.startswith("llmserve_") for n in names)
    page = (ROOT / "docs" / "guide" / "operations.md").read_text()
    assert metrics.markdown_table() in page, "docs/guide/operations.md's metrics table is stale: paste markdown_table()"


def test_cluster_config_file(tmp_path, monkeypatch):
    from llmserve.cli import build_parser
    from llmserve.launcher.up import UpConfig
    from llmserve.settings import SettingsError, resolve

    def up(argv: list[str]) -> UpConfig:
        args = build_parser().parse_args(["up", *argv])
        return resolve(UpConfig, args, file=args.config)

    monkeypatch.delenv("LLMSERVE_MAX_NUM_SEQS", raising=False)
    monkeypatch.setenv("LLMSERVE_BLOCK_SIZE", "32")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("max-num-seqs: 7\nkv_cache_memory: 1GiB\nno-prefix-caching: true\nblock-size: 8\n")
    config = up(["--config", str(cfg), "--port", "6001"])
    scheduler, runner = config.engine.scheduling, config.engine.worker.runner
    assert (scheduler.max_num_seqs, runner.kv_cache_memory, scheduler.enable_prefix_caching) == (7, 2**30, False)
    assert runner.block_size == 32  # The environment wins over the file,
    assert config.port == 6001  # and the command line over both.
    toml = tmp_path / "cluster.toml"
    toml.write_text('max-num-seqs = 9\ndtype = "bfloat16"\n')
    config = up(["--config", str(toml)])
    assert (config.engine.scheduling.max_num_seqs, config.engine.worker.runner.dtype) == (9, "bfloat16")
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-sequences: 3\n")
    with pytest.raises(SettingsError, match="unknown settings"):
        up(["--config", str(bad)])
    # The example file in the repository loads.
    up(["--config", str(ROOT / "cluster.yaml")])


def test_every_metric_carries_the_model_name():
    """Each service's metrics, recorded and observed as the services do, in an SDK meter
    read in memory: every data point of every metric has model_name, the served model's."""
    from types import SimpleNamespace

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    router = metrics.RouterMetrics(meter, model_name="m-router")
    router.request_finished(0.0, 0.5, 3, "length")
    router.ttft.record(0.1)
    router.request_routed("replica-a", "cache-aware", 64)
    scheduler = metrics.SchedulerMetrics(meter)
    scheduler.model_name = "m-scheduler"  # As a worker's registration sets it.
    scheduler.stats = SimpleNamespace(
        num_running=1, num_waiting=0, num_swapped=0, kv_cache_usage=0.5, prefix_cache_hit_rate=0.0,
        prefix_cache_queries=4, prefix_cache_hits=0, num_queued_requests=0, max_queued_requests=8,
        num_queued_tokens=0, max_queued_tokens=64, saturated=False, num_expired=0,
        num_preemptions_recompute=1, num_preemptions_swap=0, num_refused={"queued_requests": 2},
        spec_num_drafts=3, spec_num_draft_tokens=9, spec_num_accepted_tokens=5, spec_accepted_per_position=(3, 2))
    scheduler.orphaned_blocks = 0
    for instrument in (scheduler.queue_time, scheduler.step_time, scheduler.step_tokens):
        instrument.record(1)
    worker = metrics.WorkerMetrics(meter)
    worker.model_name = "m-worker"  # As the worker sets it once its model is loaded.
    worker.step_time.record(0.01)
    seen: dict[str, set[str]] = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    seen.setdefault(metric.name, set()).add(point.attributes.get("model_name"))
    expected = {s.name: {f"m-{s.service}"} for s in metrics.METRICS}
    assert seen == expected  # Every declared metric, each point labelled with its service's model.
    assert all(s.all_labels[0] == "model_name" for s in metrics.METRICS)
