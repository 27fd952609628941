"""End-to-end deadlines in the scheduler core (Scheduler.expire and the Deadlines heap,
services/scheduler/llmserve/scheduler/deadlines.py) and in the engine loop, on the fake worker."""

import asyncio
import time

from .scheduler_testkit import (NO_EOS, FakeWorker, Run, build_scheduler, make_scheduler, names, params,
                               run_until_done, step)
from .test_engine_loop import Harness, ScriptedWorker

from llmserve.contract.outputs import ErrorCode, FinishReason
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.scheduler.deadlines import COMPACT_AT, Deadlines
from llmserve.scheduler.request import RequestStatus

ERROR, LENGTH = FinishReason.ERROR, FinishReason.LENGTH


def scheduled(plan) -> set[str]:
    return set(names(plan.new_requests + plan.cached_requests))


def test_queued_request_past_its_deadline_is_never_scheduled():
    sched = make_scheduler(max_num_seqs=1)
    worker, run = FakeWorker(4), Run()
    sched.add_request("long", [1, 2, 3], params(max_tokens=6))
    sched.add_request("hurry", [4, 5, 6, 7, 8], params(max_tokens=2), deadline=10.0)
    assert sched.next_deadline() == 10.0
    for _ in range(2):
        assert sched.expire(9.9) == []
        step(sched, worker, run)
    [out] = sched.expire(10.0)
    assert (out.request_id, out.finish_reason, out.error_code) == ("hurry", ERROR, ErrorCode.DEADLINE_EXCEEDED)
    assert out.error == "deadline exceeded"
    run.record([out])
    run_until_done(sched, worker, run)
    assert all("hurry" not in scheduled(p) for p in run.plans)
    assert run.finish == {"hurry": ERROR, "long": LENGTH}
    stats = sched.stats()
    assert (stats.num_expired, stats.num_failed, stats.num_free_blocks) == (1, 1, 64)
    assert stats.prompt_tokens_total == 3  # "hurry" was never admitted.
    assert sched.next_deadline() is None and sched.expire(100.0) == []


def test_running_request_past_its_deadline_stops_and_frees_its_blocks():
    sched = make_scheduler(num_blocks=10)
    worker, run = FakeWorker(4), Run()
    sched.add_request("a", list(range(6)), params(max_tokens=10), deadline=5.0)
    sched.add_request("b", [1, 2], params(max_tokens=10))
    step(sched, worker, run)
    step(sched, worker, run)
    assert sched.stats().num_free_blocks == 7
    [out] = sched.expire(5.0)
    assert (out.request_id, out.error_code, out.new_token_ids) == ("a", ErrorCode.DEADLINE_EXCEEDED, [])
    assert sched.stats().num_free_blocks == 9  # At once, not at the next step.
    plan = step(sched, worker, run)
    assert names(plan.finished_seq_ids) == ["a"]  # The worker drops its state.
    assert scheduled(plan) == {"b"}


def test_swapped_request_past_its_deadline_frees_its_cpu_blocks():
    config = dict(block_size=4, max_model_len=64, enable_prefix_caching=False, preemption_mode="swap")
    sched = build_scheduler(config, num_blocks=3, eos=NO_EOS, num_cpu_blocks=8)
    worker, run = FakeWorker(4), Run()
    sched.add_request("a", [1, 2, 3, 4], params(max_tokens=3))
    sched.add_request("b", [1, 2, 3, 4], params(max_tokens=3))
    sched.add_request("c", [5, 6, 7, 8], params(max_tokens=3), deadline=1.0)
    step(sched, worker, run)
    step(sched, worker, run)  # "a" needs a second block: "c" then "b" are swapped out.
    assert sched.sample("c").status is RequestStatus.SWAPPED
    free_cpu = sched.stats().num_free_cpu_blocks
    [out] = sched.expire(1.0)
    assert (out.request_id, out.error_code) == ("c", ErrorCode.DEADLINE_EXCEEDED)
    assert sched.stats().num_free_cpu_blocks == free_cpu + 1
    run.record([out])
    plans_before = len(run.plans)
    run_until_done(sched, worker, run)
    assert all("c" not in scheduled(p) for p in run.plans[plans_before:])
    stats = sched.stats()
    assert (stats.num_free_blocks, stats.num_free_cpu_blocks) == (3, 8)
    assert run.finish == {"a": LENGTH, "b": LENGTH, "c": ERROR}


def test_request_finished_before_its_deadline_is_not_expired():
    sched = make_scheduler()
    worker = FakeWorker(4)
    sched.add_request("quick", [1, 2], params(max_tokens=1), deadline=3.0)
    run = run_until_done(sched, worker)
    assert run.finish == {"quick": LENGTH}
    assert sched.next_deadline() is None and sched.expire(10.0) == []
    assert sched.stats().num_expired == 0


def test_deadlines_heap_order_and_compaction():
    sched = make_scheduler()
    heap = Deadlines()
    requests = []
    for i, deadline in enumerate([5.0, 1.0, 3.0]):
        requests.append(sched.add_request(f"r{i}", [1], params(), deadline=deadline))
        heap.add(requests[-1])
    assert heap.next() == 1.0
    sched.abort_requests(["r1"])  # Finished otherwise: skipped.
    assert heap.next() == 3.0
    assert [r.request_id for r in heap.due(4.0)] == ["r2"]
    assert [r.request_id for r in heap.due(9.0)] == ["r0"]
    # Requests that finish long before their deadlines do not pile up.
    for i in range(10 * COMPACT_AT):
        request = sched.add_request(f"x{i}", [1], params(), deadline=1e9)
        heap.add(request)
        sched.abort_requests([f"x{i}"])
    assert len(heap) <= COMPACT_AT and heap.next() is None


# ---- in the engine loop ----


class SlowWorker(ScriptedWorker):
    """Steps take a few milliseconds, so deadlines pass while requests queue."""

    async def execute(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0.005)
        return await super().execute(plan)


async def test_engine_loop_ends_a_queued_request_at_its_deadline():
    worker = SlowWorker()
    h = Harness(worker, max_num_seqs=1)
    h.add("long", max_tokens=40)  # At least 200 ms of 5 ms steps: the only seat.
    h.core.add_request("hurry", [6, 7, 8], params(max_tokens=2), deadline=time.monotonic() + 0.05)
    await h.run_until_idle()
    ends = h.ends()
    assert ends[("long", 0)].finish_reason == LENGTH
    assert (ends[("hurry", 0)].finish_reason, ends[("hurry", 0)].error_code) == (ERROR, ErrorCode.DEADLINE_EXCEEDED)
    assert all("hurry" not in names(p.new_requests) for p in worker.plans)
    assert h.core.stats().num_expired == 1
    h.assert_no_blocks_held()


async def test_an_idle_engine_loop_wakes_up_for_a_deadline():
    h = Harness(ScriptedWorker())
    h.core.schedule = lambda: StepPlan(step_id=0)  # Nothing can run, and no work arrives.
    h.core.add_request("stuck", [1, 2, 3], params(), deadline=time.monotonic() + 0.05)
    task = asyncio.create_task(h.loop.run())
    try:
        await asyncio.wait_for(_ended(h, "stuck"), 2.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert h.ends()[("stuck", 0)].error_code == ErrorCode.DEADLINE_EXCEEDED
    assert not h.core.has_unfinished_requests()


async def _ended(h, request_id: str) -> None:
    while (request_id, 0) not in h.ends():
        await asyncio.sleep(0.005)
