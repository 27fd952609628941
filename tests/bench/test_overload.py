"""`llmserve bench overload`, briefly, on a cluster with two seats and a two-request
queue offered 8x what it serves: the invariants that do not depend on timing (every
request completes with all its tokens or is refused with RESOURCE_EXHAUSTED and a
RetryInfo; nothing leaks). The timing figures are the full benchmark's business."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmserve.bench.overload import Outcome, quantiles_ms


def test_outcome_kinds():
    assert Outcome(0.0, 0.1, 0.5, num_tokens=8, finish="length").kind(8) == "completed"
    assert Outcome(0.0, 0.1, 0.5, num_tokens=7, finish="length").kind(8) == "violation"  # Short.
    assert Outcome(0.0, end=0.01, code="RESOURCE_EXHAUSTED", retry_after_s=0.2).kind(8) == "refused"
    assert Outcome(0.0, end=0.01, code="RESOURCE_EXHAUSTED").kind(8) == "violation"  # No RetryInfo.
    assert Outcome(0.0, end=0.01, code="UNAVAILABLE").kind(8) == "violation"
    assert quantiles_ms([0.001 * i for i in range(1, 101)]) == pytest.approx({"p50": 50.0, "p99": 99.0, "max": 100.0})


@pytest.mark.slow
def test_bench_overload_smoke(tmp_path):
    args = ["bench", "overload", "--launch", "--kv-cache-memory", "128MiB", "--max-num-seqs", "2",
            "--max-queued-requests", "2", "--unloaded-requests", "2", "--calibrate-s", "3", "--duration", "4",
            "--overload", "8", "--output-len", "8", "--output-dir", str(tmp_path)]
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "--log-level", "ERROR", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    [path] = tmp_path.glob("overload-*.json")
    report = json.loads(path.read_text())
    assert report["violations"] == 0, report["violation_examples"]
    assert report["completed"] >= 1 and report["refused"] >= 1
    assert report["completed"] + report["refused"] == report["requests"]
    # The scheduler refused exactly the requests the client saw refused, for the request bound.
    assert report["scheduler"]["num_refused"] == {"queued_requests": report["refused"], "queued_tokens": 0,
                                                  "displaced": 0}
    assert report["retry_after_ms"]["p50"] > 0
    assert report["leaked_blocks"] == 0 and report["idle"] and not report["scheduler"]["saturated_after"]
    assert report["acceptance"]["every_request_completed_or_refused"] and report["acceptance"]["no_leaked_blocks"]
    assert "refusal latency" in out.stdout and "TTFT overloaded" in out.stdout
