"""The step watchdog: its bound (floors, learned from recent steps, scaled by a plan's
steps), when it fires with two plans in flight, and the session dropping a worker that
stopped answering (its requests end UNAVAILABLE naming it, health NOT_SERVING)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from llmserve.contract.outputs import ErrorCode
from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan, StepResult
from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.config import StepWatchdogConfig
from llmserve.scheduler.step_watchdog import MIN_SAMPLES, StepWatchdog, token_counts

from .scheduler_testkit import FakeWorker, make_scheduler

CONFIG = StepWatchdogConfig(floor_s=5.0, factor=10.0, warmup_steps=3, warmup_floor_s=60.0, prefill_floor_s=20.0)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def decode(step_id: int, rows: int = 3, num_steps: int = 1) -> StepPlan:
    return StepPlan(step_id, cached_requests=[CachedRequestData(seq, [], 10, 1) for seq in range(rows)],
                    num_steps=num_steps)


def prefill(step_id: int, tokens: int = 64) -> StepPlan:
    row = NewRequestData(7, list(range(tokens)), tokens, SamplingParams(), [0], 0, tokens)
    return StepPlan(step_id, new_requests=[row], cached_requests=[CachedRequestData(1, [], 10, 1)])


def run_steps(dog: StepWatchdog, clock: Clock, first_id: int, count: int, seconds: float, num_steps: int = 1,
              make=decode) -> int:
    """`count` plans answered one after another, each after `seconds`; the next step id."""
    for step_id in range(first_id, first_id + count):
        plan = make(step_id, num_steps=num_steps) if make is decode else make(step_id)
        dog.started(plan)
        clock.now += seconds
        dog.finished(plan, StepResult(step_id, num_steps=num_steps))
    return first_id + count


def test_prompt_tokens_are_what_is_beyond_one_token_per_row_and_its_drafts():
    assert token_counts(decode(1, rows=5)) == (5, 0)
    assert token_counts(prefill(1, tokens=64)) == (65, 63)  # The new row's last token is "its" one.
    drafted = decode(1, rows=2)
    for row in drafted.cached_requests:
        row.draft_token_ids, row.num_scheduled_tokens = [5, 6, 7], 4
    assert token_counts(drafted) == (8, 0)  # Speculative decoding is not prefill.


def test_floors_apply_until_enough_steps_were_timed():
    clock = Clock()
    dog = StepWatchdog(CONFIG, clock)
    assert dog.bound(decode(1)) == 60.0  # Warm-up: the first steps after registration.
    next_id = run_steps(dog, clock, 1, 3, 0.01)
    assert dog.bound(decode(next_id)) == 5.0  # Warm-up over, too few samples to learn from.
    assert dog.bound(prefill(next_id)) == 20.0  # Prefill-heavy: its own floor.
    assert dog.bound(decode(next_id, num_steps=8)) == 5.0  # The floor does not scale.


def test_the_learned_bound_is_factor_times_p99_and_scales_with_num_steps():
    clock = Clock()
    dog = StepWatchdog(CONFIG, clock)
    next_id = run_steps(dog, clock, 1, MIN_SAMPLES + 20, 1.0)
    assert dog.bound(decode(next_id)) == pytest.approx(10.0)  # 10 x 1 s, above the 5 s floor.
    assert dog.bound(decode(next_id, num_steps=4)) == pytest.approx(40.0)
    # Multi-step plans are timed per step: 4 steps in 8 s is 2 s a step.
    next_id = run_steps(dog, clock, next_id, 300, 8.0, num_steps=4)
    assert dog.bound(decode(next_id)) == pytest.approx(20.0)
    # An interrupted multi-step plan is timed by the steps it ran (2 of 4 in 4 s: 2 s each).
    plan = decode(next_id, num_steps=4)
    dog.started(plan)
    clock.now += 4.0
    dog.finished(plan, StepResult(next_id, num_steps=2))
    assert dog.bound(decode(next_id + 1)) == pytest.approx(20.0)


def test_warm_up_steps_are_not_learned_from():
    clock = Clock()
    dog = StepWatchdog(CONFIG, clock)
    next_id = run_steps(dog, clock, 1, CONFIG.warmup_steps, 50.0)  # Slow, as first steps are.
    next_id = run_steps(dog, clock, next_id, MIN_SAMPLES, 0.1)
    assert dog.bound(decode(next_id)) == 5.0


def test_prefill_heavy_steps_are_timed_apart_from_decodes():
    clock = Clock()
    dog = StepWatchdog(CONFIG, clock)
    next_id = run_steps(dog, clock, 1, CONFIG.warmup_steps + 50, 0.1)
    next_id = run_steps(dog, clock, next_id, 10, 4.0, make=prefill)  # Long prefills among decodes.
    assert dog.bound(decode(next_id)) == 5.0  # Decode bounds stay tight...
    assert dog.bound(prefill(next_id)) == pytest.approx(40.0)  # ...prefills learn from prefills.


def test_p99_ignores_a_rare_slow_step_but_not_a_slow_tail():
    clock = Clock()
    dog = StepWatchdog(CONFIG, clock)
    next_id = run_steps(dog, clock, 1, 199, 0.1)
    next_id = run_steps(dog, clock, next_id, 1, 30.0)  # One odd step among 200.
    assert dog.bound(decode(next_id)) == pytest.approx(5.0)  # 10 x 0.1 s: the floor.
    next_id = run_steps(dog, clock, next_id, 5, 2.0)  # 5 of the 205 slow: the tail counts.
    assert dog.bound(decode(next_id)) == pytest.approx(20.0)


def test_two_plans_in_flight_the_second_is_timed_from_the_first_answer():
    clock = Clock()
    dog = StepWatchdog(CONFIG, clock)
    next_id = run_steps(dog, clock, 1, 300, 0.1)  # Bound: the 5 s floor, one slow step or not.
    first, second = decode(next_id), decode(next_id + 1)
    dog.started(first)
    dog.started(second)  # Pipelined: sent while the first runs.
    assert dog.in_flight == [first.step_id, second.step_id]
    clock.now += 4.9
    assert dog.check() is None
    dog.finished(first, StepResult(first.step_id))
    clock.now += 4.9  # 9.8 s after it was sent, but only 4.9 s since the worker could start it.
    assert dog.check() is None
    clock.now += 0.2
    stall = dog.check()
    assert stall is not None and stall.step_id == second.step_id
    assert stall.running_s == pytest.approx(5.1) and stall.bound_s == pytest.approx(5.0)
    message = stall.describe("10.0.0.7:50061")
    assert "10.0.0.7:50061" in message and "stopped answering" in message and "5.1 s" in message


def test_the_oldest_plan_fires_and_an_answer_clears_older_plans():
    clock = Clock()
    dog = StepWatchdog(CONFIG, clock)
    next_id = run_steps(dog, clock, 1, MIN_SAMPLES + 2, 0.1)
    first, second = decode(next_id), decode(next_id + 1)
    dog.started(first)
    dog.started(second)
    clock.now += 5.5
    assert dog.check().step_id == first.step_id
    # Answers come in order: the second's answer means the first was answered too.
    dog.finished(second, StepResult(second.step_id))
    assert dog.in_flight == [] and dog.check() is None
    dog.finished(first, StepResult(first.step_id))  # Late, unknown: ignored.
    assert dog.num_answered == MIN_SAMPLES + 3


def test_a_failed_step_is_not_learned_from():
    clock = Clock()
    dog = StepWatchdog(CONFIG, clock)
    next_id = run_steps(dog, clock, 1, MIN_SAMPLES + 2, 0.1)
    plan = decode(next_id)
    dog.started(plan)
    clock.now += 400.0
    dog.finished(plan, StepResult(plan.step_id, error="boom"))
    assert dog.bound(decode(next_id + 1)) == 5.0


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="floor_s"):
        StepWatchdogConfig(floor_s=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        StepWatchdogConfig(warmup_steps=-1)


async def test_watch_fires_once_past_the_bound_and_not_while_steps_are_answered():
    dog = StepWatchdog(StepWatchdogConfig(floor_s=0.15, warmup_steps=0, prefill_floor_s=0.15))
    stalls = []

    async def on_stall(stall):
        stalls.append((stall, time.monotonic()))

    watcher = asyncio.create_task(dog.watch(on_stall, poll_s=0.01))
    for step_id in range(1, 6):  # Answered in time: nothing fires.
        dog.started(decode(step_id))
        await asyncio.sleep(0.05)
        dog.finished(decode(step_id), StepResult(step_id))
    assert not stalls
    sent = time.monotonic()
    dog.started(decode(6))
    dog.started(decode(7))
    await asyncio.wait_for(watcher, 2.0)  # watch() returns after reporting.
    [(stall, at)] = stalls
    assert stall.step_id == 6 and 0.15 <= at - sent < 0.5


class HangingWorker:
    """Answers like FakeWorker until `hang_at` steps were sent, then never again."""

    address = "127.0.0.1:59999"
    info = SimpleNamespace(bos_token_id=1)

    def __init__(self, hang_at: int):
        self.fake, self.hang_at, self.sent, self.closed = FakeWorker(4), hang_at, 0, False

    def interrupt(self) -> None:
        pass

    async def execute(self, plan: StepPlan) -> StepResult:
        self.sent += 1
        if self.sent >= self.hang_at:
            await asyncio.Event().wait()
        return self.fake.execute(plan)

    async def alive(self) -> bool:
        return True  # As a stopped process's health check looks: no answer is no "gone".

    async def close(self) -> None:
        self.closed = True


async def test_a_session_drops_a_worker_whose_step_goes_unanswered():
    from llmserve.contract import wire
    from llmserve.contract.grpc_server import NOT_SERVING, ServiceServer
    from llmserve.contract.security import SecurityOptions
    from llmserve.scheduler.config import SchedulerServiceConfig
    from llmserve.scheduler.engine_session import EngineState
    from llmserve.scheduler.routers import RouterSession
    from llmserve.scheduler.service import SchedulerServicer
    from grpc_health.v1 import health_pb2

    server = ServiceServer("llmserve.internal.v1.Scheduler", "127.0.0.1", 0, SecurityOptions(insecure=True))
    watchdog = StepWatchdogConfig(floor_s=0.3, warmup_steps=0, prefill_floor_s=0.3)
    servicer = SchedulerServicer(SchedulerServiceConfig(step_watchdog=watchdog), server)
    worker = HangingWorker(hang_at=6)
    engine = servicer.new_engine(make_scheduler(max_num_seqs=16, max_num_batched_tokens=64), worker)
    engine.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while engine.state is not EngineState.SERVING:
        assert loop.time() < deadline, "the readiness step never ran"
        await asyncio.sleep(0.01)
    session = RouterSession()
    for request_id in ("a", "b", "c"):
        servicer.add(session, wire.add_request_to_pb(request_id, [1, 2, 3], SamplingParams(max_tokens=50), n=1))
    while not engine.lost:
        assert loop.time() < deadline, "the stalled worker was never dropped"
        await asyncio.sleep(0.01)
    ends = []
    while not session.updates.empty():
        ends += [o for o in (await session.next_update()).outputs if o.finish_reason]
    assert sorted(o.request_id for o in ends) == ["a", "b", "c"]
    for out in ends:
        assert out.error_code == ErrorCode.UNAVAILABLE
        assert f"the worker at {worker.address} stopped answering" in out.error and "has run 0." in out.error
    assert worker.closed and worker.sent == 6
    status = await server.health.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert status.status == NOT_SERVING
