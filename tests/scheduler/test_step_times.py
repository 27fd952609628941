"""The engine loop's step totals tell decode steps from steps carrying prompt tokens."""

from __future__ import annotations

import pytest

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan, WorkerSamplingParams
from llmserve.scheduler.step_times import StepTimes, is_decode_step


def new(rid: str, n: int) -> NewRequestData:
    return NewRequestData(rid, list(range(n)), n, WorkerSamplingParams(), [0], 0, n)


def cached(rid: str, n: int) -> CachedRequestData:
    return CachedRequestData(rid, [], 10, n)


def test_decode_step_is_one_token_per_sequence():
    assert is_decode_step(StepPlan(0, cached_requests=[cached("a", 1), cached("b", 1)]))
    assert not is_decode_step(StepPlan(0, cached_requests=[cached("a", 1), cached("b", 7)]))  # a prompt chunk
    assert not is_decode_step(StepPlan(0, new_requests=[new("c", 5)], cached_requests=[cached("a", 1)]))
    assert not is_decode_step(StepPlan(0, swap_in=[(0, 1)]))  # block moves only: no sequence


def test_totals_split_by_kind():
    t = StepTimes()
    t.record(StepPlan(0, new_requests=[new("a", 30)]), 0.5, 0.4)
    t.record(StepPlan(1, cached_requests=[cached("a", 1)], new_requests=[new("b", 20)]), 0.3, 0.25)
    t.record(StepPlan(2, cached_requests=[cached("a", 1), cached("b", 1)]), 0.05, 0.04)
    t.record(StepPlan(3, cached_requests=[cached("a", 1), cached("b", 1)]), 0.07, 0.06)
    t.record(StepPlan(4, swap_out=[(3, 0)]), 0.01, 0.01)  # nothing computed: not counted
    assert (t.num_decode_steps, t.decode_step_sequences) == (2, 4)
    assert t.decode_step_seconds == pytest.approx(0.12) and t.decode_step_worker_seconds == pytest.approx(0.10)
    assert (t.num_prefill_steps, t.prefill_step_tokens) == (2, 51)
    assert t.prefill_step_seconds == pytest.approx(0.8)


def test_a_multi_step_plan_counts_every_step_it_ran():
    t = StepTimes()
    t.record(StepPlan(0, cached_requests=[cached("a", 1), cached("b", 1)], num_steps=4), 0.2, 0.19, num_steps=3)
    t.record(StepPlan(1, cached_requests=[cached("a", 1)]), 0.05, 0.04)
    assert (t.num_decode_steps, t.num_decode_plans, t.decode_step_sequences) == (4, 2, 7)
    assert t.decode_step_seconds == pytest.approx(0.25)  # per step: 0.0625 s


def test_decode_totals_by_batch_size():
    t = StepTimes()
    t.record(StepPlan(0, cached_requests=[cached("a", 1)]), 0.04, 0.03)  # batch 1, 40 ms
    t.record(StepPlan(1, cached_requests=[cached(r, 1) for r in "abc"], num_steps=2), 0.12, 0.11, num_steps=2)
    t.record(StepPlan(2, cached_requests=[cached("a", 1)]), 0.05, 0.04)
    assert t.decode_steps_by_batch == {1: 2, 3: 2}
    assert t.decode_seconds_by_batch == pytest.approx({1: 0.09, 3: 0.12})
    assert t.decode_step_sequences == 8 and t.num_decode_steps == 4
