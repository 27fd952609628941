"""`bench serve`'s cluster step totals, derived from the scheduler.step and worker.step
spans of a span file: decode steps told from steps carrying prompt tokens, multi-step
plans counted by the steps they ran, decode totals by batch size, the run's window."""

from __future__ import annotations

import json
import math

import pytest

from llmserve.bench.step_compare import engine_steps
from llmserve.bench.step_spans import read_spans, step_totals

MS = 1_000_000  # nanoseconds


class Trace:
    """Synthetic spans as the JSON-lines exporter writes them."""

    def __init__(self):
        self.spans: list[dict] = []
        self._ids = iter(range(1, 10_000))

    def _span(self, name, start_ms, ms, attributes, trace_id, parent=None) -> dict:
        span = {"name": name, "service": "llmserve-" + name.split(".")[0], "trace_id": trace_id,
                "span_id": f"{next(self._ids):016x}", "parent_span_id": parent, "kind": "INTERNAL",
                "start_ns": start_ms * MS, "end_ns": (start_ms + ms) * MS, "attributes": attributes,
                "links": [], "status": "UNSET"}
        self.spans.append(span)
        return span

    def step(self, start_ms: int, ms: int, batch: int, tokens: int, worker_ms: list[int] = (),
             num_steps: int | None = None) -> dict:
        """A scheduler.step span and one worker.step child per entry of `worker_ms` (ranks)."""
        trace_id = f"{len(self.spans) + 1:032x}"
        step = self._span("scheduler.step", start_ms, ms, {
            "llmserve.batch_size": batch, "llmserve.num_scheduled_tokens": tokens,
            "llmserve.num_new_request_tokens": 0}, trace_id)
        for wms in worker_ms:
            attributes = {"llmserve.batch_size": batch, "llmserve.num_scheduled_tokens": tokens}
            if num_steps is not None:
                attributes["llmserve.num_steps"] = num_steps
            self._span("worker.step", start_ms + 1, wms, attributes, trace_id, parent=step["span_id"])
        return step


def a_run() -> Trace:
    t = Trace()
    t.step(0, 40, batch=1, tokens=1, worker_ms=[30])  # The readiness step, before the run.
    t.step(1000, 500, batch=1, tokens=30, worker_ms=[400])  # a's prompt
    t.step(1500, 300, batch=2, tokens=21, worker_ms=[250])  # a decodes, b's prompt
    t.step(1800, 50, batch=2, tokens=2, worker_ms=[40], num_steps=1)
    t.step(1850, 70, batch=2, tokens=2, worker_ms=[60], num_steps=1)
    t.step(1920, 10, batch=0, tokens=0, worker_ms=[5])  # Block moves only: nothing computed.
    t.step(1930, 200, batch=2, tokens=2, worker_ms=[190], num_steps=3)  # A multi-step plan: 3 of 4 ran.
    last = t.step(2130, 50, batch=1, tokens=1, worker_ms=[30, 45])  # Two ranks: the slower one counts.
    # Same parent span id in another trace: not a child of the step above.
    t._span("worker.step", 2131, 900, {"llmserve.num_steps": 8}, "f" * 32, parent=last["span_id"])
    t._span("scheduler.request", 1000, 1200, {"llmserve.request_id": "a"}, "e" * 32)
    t.step(9000, 50, batch=1, tokens=1, worker_ms=[30])  # After the run.
    return t


def test_totals_split_decode_from_prefill_steps_within_the_window():
    t = step_totals(a_run().spans, start_ns=1000 * MS, end_ns=8000 * MS)
    assert (t.num_prefill_steps, t.prefill_step_tokens) == (2, 51)
    assert t.prefill_step_seconds == pytest.approx(0.8)
    assert (t.num_decode_plans, t.num_decode_steps, t.decode_step_sequences) == (4, 6, 11)
    assert t.decode_step_seconds == pytest.approx(0.37)
    assert t.decode_step_worker_seconds == pytest.approx(0.04 + 0.06 + 0.19 + 0.045)
    assert t.worker_seconds_known


def test_decode_totals_by_batch_size_count_every_step_a_plan_ran():
    t = step_totals(a_run().spans, start_ns=1000 * MS, end_ns=8000 * MS)
    assert t.decode_steps_by_batch == {1: 1, 2: 5}
    assert t.decode_seconds_by_batch == pytest.approx({1: 0.05, 2: 0.32})
    # Without the window: the readiness step and the one after the run are batch-1 decodes too.
    everything = step_totals(a_run().spans)
    assert everything.decode_steps_by_batch == {1: 3, 2: 5} and everything.num_decode_plans == 6


def test_a_decode_step_is_one_token_per_sequence():
    t = Trace()
    t.step(0, 10, batch=2, tokens=2, worker_ms=[5])  # decode
    t.step(10, 10, batch=2, tokens=8, worker_ms=[5])  # a prompt chunk beside a decode
    t.step(20, 10, batch=1, tokens=1, worker_ms=[5])  # decode
    totals = step_totals(t.spans)
    assert (totals.num_decode_plans, totals.num_prefill_steps, totals.prefill_step_tokens) == (2, 1, 8)


def test_figures_from_the_totals():
    e = engine_steps(step_totals(a_run().spans, start_ns=1000 * MS, end_ns=8000 * MS))
    assert (e["num_decode_steps"], e["num_prefill_steps"]) == (6, 2)
    assert e["decode_step_ms"] == pytest.approx(370 / 6)
    assert e["decode_step_worker_ms"] == pytest.approx(335 / 6)
    assert e["decode_batch"] == pytest.approx(11 / 6)
    assert e["decode_steps_per_plan"] == pytest.approx(1.5)
    # 11 decoded tokens: 1 at batch 1, 10 at batch 2 (5 steps of 320 ms in all).
    by_batch = e["decode_by_batch"]
    assert list(by_batch) == [1, 2]
    assert by_batch[1] == pytest.approx({"steps": 1, "token_share": 1 / 11, "ms": 50.0})
    assert by_batch[2] == pytest.approx({"steps": 5, "token_share": 10 / 11, "ms": 64.0})
    assert e["decode_batch_per_token"] == pytest.approx(21 / 11)
    assert e["decode_step_ms_per_token"] == pytest.approx((50 + 640) / 11)
    assert (e["prefill_step_ms"], e["prefill_step_tokens"]) == pytest.approx((400.0, 25.5))
    assert e["prefill_time_share"] == pytest.approx(0.8 / 1.17)


def test_without_worker_spans_the_worker_time_is_unknown():
    t = Trace()
    t.step(0, 10, batch=2, tokens=2)
    t.step(10, 10, batch=2, tokens=2, worker_ms=[5])
    totals = step_totals(t.spans)
    assert totals.num_decode_plans_without_worker_span == 1 and not totals.worker_seconds_known
    assert math.isnan(engine_steps(totals)["decode_step_worker_ms"])


def test_read_spans_leaves_out_a_line_being_written(tmp_path):
    spans = a_run().spans
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in spans) + '{"name": "scheduler.st')
    assert read_spans(path) == spans
    path.write_text("")
    assert read_spans(path) == []
