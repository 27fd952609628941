"""`llmserve bench overload`'s bookkeeping (its brief run against a cluster is in
tests/e2e/test_admission.py, sharing that file's cluster)."""

from __future__ import annotations

import pytest

from llmserve.bench.overload import Outcome, quantiles_ms


def test_outcome_kinds():
    assert Outcome(0.0, 0.1, 0.5, num_tokens=8, finish="length").kind(8) == "completed"
    assert Outcome(0.0, 0.1, 0.5, num_tokens=7, finish="length").kind(8) == "violation"  # Short.
    assert Outcome(0.0, end=0.01, code="RESOURCE_EXHAUSTED", retry_after_s=0.2).kind(8) == "refused"
    assert Outcome(0.0, end=0.01, code="RESOURCE_EXHAUSTED").kind(8) == "violation"  # No RetryInfo.
    assert Outcome(0.0, end=0.01, code="UNAVAILABLE").kind(8) == "violation"
    assert quantiles_ms([0.001 * i for i in range(1, 101)]) == pytest.approx({"p50": 50.0, "p99": 99.0, "max": 100.0})


def test_command_line():
    from llmserve.cli import build_parser

    args = build_parser().parse_args(["bench", "overload", "--launch", "--max-num-seqs", "8",
                                      "--max-queued-requests", "2", "--duration", "5", "--overload", "3"])
    assert (args.bench_command, args.launch, args.duration, args.overload) == ("overload", True, 5.0, 3.0)
    assert (args.max_num_seqs, args.max_queued_requests) == (8, 2)
