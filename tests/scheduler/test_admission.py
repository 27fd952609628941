"""Admission control: the queue bounds, displacement by priority, the retry hint and
saturation (services/scheduler/llmserve/scheduler/admission.py), on the fake worker."""

import pytest

from .scheduler_testkit import FakeWorker, Run, make_scheduler, names, params, run_until_done, step

from llmserve.contract.outputs import ErrorCode, FinishReason
from llmserve.scheduler.admission import RETRY_MAX_MS, RETRY_MIN_MS, DrainRate, QueueFull

NO_REFUSALS = {"queued_requests": 0, "queued_tokens": 0, "displaced": 0}


class Clock:
    """A settable stand-in for time.monotonic."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def seated(max_queued_requests=None, max_queued_tokens=None, clock=None, num_blocks=64):
    """A scheduler with one seat, taken by request "run" (3 prompt tokens, 8 to generate)."""
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=1, max_queued_requests=max_queued_requests,
                           max_queued_tokens=max_queued_tokens, clock=clock or Clock())
    worker, run = FakeWorker(4), Run()
    sched.submit("run", [1, 2, 3], params(max_tokens=8))
    step(sched, worker, run)
    return sched, worker, run


def test_full_queue_refuses_at_once_with_a_retry_hint_and_takes_nothing():
    clock = Clock()
    sched, worker, run = seated(max_queued_requests=2, clock=clock)  # At t=0 "run" left the queue.
    sched.submit("q1", [1, 2, 3, 4, 5], params())
    sched.submit("q2", [6], params())
    before = sched.stats()
    clock.now = 1.0
    with pytest.raises(QueueFull) as refused:
        sched.submit("q3", [7, 8], params())
    # Drained lately: 1 request (3 prompt tokens) in 1 s. Queued: 2 requests, 6 tokens.
    # max(2 / 1 per s, 6 / 3 per s) = 2 s.
    assert (refused.value.reason, refused.value.retry_after_ms) == ("queued_requests", 2000)
    assert "--max-queued-requests (2) reached" in str(refused.value) and "retry in 2000 ms" in str(refused.value)
    assert sched.get_request("q3") is None
    after = sched.stats()
    assert (after.num_queued_requests, after.num_queued_tokens) == (2, 6)
    assert (after.max_queued_requests, after.num_free_blocks) == (2, before.num_free_blocks)
    assert after.num_refused == {**NO_REFUSALS, "queued_requests": 1}
    assert after.saturated
    # The refused id was never taken: once there is room it queues.
    sched.abort_requests(["q2"])
    sched.submit("q3", [7, 8], params())
    assert [s.label for s in sched.waiting] == ["q1", "q3"]


def test_token_bound_counts_the_tokens_queued_requests_must_compute():
    sched, worker, run = seated(max_queued_requests=100, max_queued_tokens=10)
    sched.submit("a", list(range(8)), params())
    with pytest.raises(QueueFull) as refused:
        sched.submit("b", [1, 2, 3], params())  # 8 + 3 > 10
    assert refused.value.reason == "queued_tokens"
    assert "--max-queued-tokens (10) reached: queued requests have 8 tokens to compute, this one 3" in str(
        refused.value)
    sched.submit("c", [1, 2], params())  # 8 + 2 = 10 fits
    stats = sched.stats()
    assert (stats.num_queued_requests, stats.num_queued_tokens) == (2, 10)
    assert stats.num_refused == {**NO_REFUSALS, "queued_tokens": 1}


def test_an_empty_queue_takes_any_prompt():
    sched, worker, run = seated(max_queued_requests=100, max_queued_tokens=4)
    sched.submit("big", list(range(20)), params(max_tokens=1))  # Longer than the bound, queue empty.
    with pytest.raises(QueueFull) as refused:
        sched.submit("small", [1], params())
    assert refused.value.reason == "queued_tokens"
    run_until_done(sched, worker, run)
    assert run.finish == {"run": FinishReason.LENGTH, "big": FinishReason.LENGTH}


def test_better_priority_displaces_the_worst_queued_request():
    sched, worker, run = seated(max_queued_requests=2)
    sched.submit("p0", [1, 2], params(max_tokens=2), priority=0)
    sched.submit("p5", [3, 4, 5, 6], params(max_tokens=2), priority=5)
    free = sched.stats().num_free_blocks
    _, outputs = sched.submit("p1", [7, 8], params(max_tokens=2), priority=1)
    assert [(o.request_id, o.finish_reason, o.error_code) for o in outputs] == [
        ("p5", FinishReason.ERROR, ErrorCode.RESOURCE_EXHAUSTED)]
    assert outputs[0].retry_after_ms >= RETRY_MIN_MS and "better priority" in outputs[0].error
    assert sched.get_request("p5") is None and sched.stats().num_free_blocks == free
    assert [s.label for s in sched.waiting] == ["p0", "p1"]
    # No queued request is of strictly worse priority than these: refused, nobody displaced.
    for rid, priority in (("same", 1), ("worse", 3)):
        with pytest.raises(QueueFull):
            sched.submit(rid, [1], params(), priority=priority)
    assert [s.label for s in sched.waiting] == ["p0", "p1"]
    assert sched.stats().num_refused == {"queued_requests": 2, "queued_tokens": 0, "displaced": 1}
    run.record(outputs)
    run_until_done(sched, worker, run)
    assert not any("p5" in names(p.new_requests) for p in run.plans)
    assert run.finish == {"run": FinishReason.LENGTH, "p0": FinishReason.LENGTH, "p5": FinishReason.ERROR,
                          "p1": FinishReason.LENGTH}
    assert sched.stats().num_free_blocks == 64


def test_a_started_request_is_not_displaced():
    sched = make_scheduler(max_num_seqs=1, max_queued_requests=1, clock=Clock())
    worker, run = FakeWorker(4), Run()
    sched.submit("low", [1, 2, 3], params(max_tokens=8), priority=5)
    step(sched, worker, run)
    sched.submit("high", [4, 5], params(max_tokens=2), priority=0)
    step(sched, worker, run)  # "high" preempts "low" for its seat: "low" waits again, started.
    assert [s.label for s in sched.waiting] == ["low"] and run.tokens["low"]
    with pytest.raises(QueueFull):
        sched.submit("mid", [6], params(), priority=1)
    assert [s.label for s in sched.waiting] == ["low"]


def test_saturation_lasts_until_the_queue_drains_to_half():
    sched, worker, run = seated(max_queued_requests=4)
    for i in range(4):
        sched.submit(f"q{i}", [1, 2], params())
    assert not sched.saturated  # Full, but nobody refused yet.
    with pytest.raises(QueueFull):
        sched.submit("x", [1], params())
    assert sched.saturated
    sched.abort_requests(["q0"])
    assert sched.saturated and sched.stats().saturated  # 3 queued > 4 / 2
    sched.abort_requests(["q1"])
    assert not sched.saturated and not sched.stats().saturated


def test_refusal_leaves_queues_and_blocks_as_they_were():
    sched, worker, run = seated(max_queued_requests=1)
    sched.submit("q", [1, 2, 3, 4, 5, 6, 7], params())
    snapshot = (list(sched.waiting), list(sched.running), sched.stats().num_free_blocks)
    for i in range(50):
        with pytest.raises(QueueFull):
            sched.submit(f"r{i}", [1, 2, 3], params())
    assert (list(sched.waiting), list(sched.running), sched.stats().num_free_blocks) == snapshot
    run_until_done(sched, worker, run)
    assert sched.stats().num_free_blocks == 64 and set(run.finish) == {"run", "q"}


def test_free_seats_do_not_count_against_the_bound():
    sched = make_scheduler(max_num_seqs=2, max_queued_requests=1)
    for rid in ("a", "b", "c"):  # a and b take the two free seats at the next step: c is the queue.
        sched.submit(rid, [1, 2], params(max_tokens=2))
    with pytest.raises(QueueFull):
        sched.submit("d", [1, 2], params(max_tokens=2))
    plan = sched.schedule()
    assert names(plan.new_requests) == ["a", "b"]
    assert [s.label for s in sched.waiting] == ["c"]


def test_in_process_add_request_ignores_the_bounds():
    sched = make_scheduler(max_num_seqs=1, max_queued_requests=1)
    for i in range(5):
        sched.add_request(f"r{i}", [1, 2], params(max_tokens=2))
    assert sched.stats().num_queued_requests == 5 and sched.stats().num_refused == NO_REFUSALS


def test_unset_bounds_follow_the_batch():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=100)
    stats = sched.stats()
    assert (stats.max_queued_requests, stats.max_queued_tokens) == (3, 6400)
    for i in range(6):  # 3 seats free, then 3 waiting.
        sched.submit(f"r{i}", [1], params())
    with pytest.raises(QueueFull):
        sched.submit("r6", [1], params())


# ---- the retry hint ----


def test_drain_rate_retry_hint():
    rate = DrainRate(window_s=10.0)
    assert rate.retry_after_ms(0.0, 3, 8) == RETRY_MAX_MS  # Nothing known yet.
    rate.record(0.0, 0, 0)
    rate.record(1.0, 2, 8)
    rate.record(2.0, 2, 8)
    assert rate.rates(2.0) == (2.0, 8.0)  # 4 requests, 16 tokens over 2 s.
    assert rate.retry_after_ms(2.0, 3, 8) == 1500  # max(3 / 2, 8 / 8) s
    assert rate.retry_after_ms(2.0, 3, 40) == 5000  # the tokens dominate
    assert rate.retry_after_ms(2.0, 0, 0) == RETRY_MIN_MS  # never 0
    assert rate.retry_after_ms(2.0, 10**6, 0) == RETRY_MAX_MS  # bounded
    assert rate.rates(11.5) == (2 / 10, 8 / 10)  # The admissions at 1.0 left the window.
    assert rate.retry_after_ms(12.5, 1, 1) == RETRY_MAX_MS  # Nothing admitted for 10 s: stalled.
