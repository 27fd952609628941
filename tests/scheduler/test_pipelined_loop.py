"""The pipelined engine loop (async_scheduling) against the serial one: the same seeded
random workloads (greedy and seeded sampling, n > 1, aborts and deadline ends mid-run,
preemption by swap and recompute, prefix caching, speculative drafts, multi-step) give
every request the same tokens and end, and leave no block held.

The fake executor runs each plan on the testkit's FakeWorker when it is sent and hands
the result back only when asked, as the real worker does: plans run in the order sent,
and a worker's own samples are in its copy of a sequence before the next plan runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import deque

import pytest

from llmserve.contract.outputs import ErrorCode
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.scheduler.engine_loop import EngineLoop
from llmserve.scheduler.scheduler import Scheduler

from tests.scheduler.differential_trace import Arrival, draw_arrivals, draw_config, repeating_token
from tests.scheduler.scheduler_testkit import FakeWorker, Run, hash_token

NUM_WORKLOADS = 300


class DeferredWorker:
    """A StepExecutor over a FakeWorker: runs a plan when sent, answers when received."""

    def __init__(self, worker: FakeWorker):
        self.worker = worker
        self.results: deque[StepResult] = deque()

    async def send(self, plan: StepPlan) -> None:
        self.results.append(self.worker.execute(plan))

    async def receive(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0)
        result = self.results.popleft()
        assert result.step_id == plan.step_id, "results come back in the order plans were sent"
        return result

    async def execute(self, plan: StepPlan) -> StepResult:
        await self.send(plan)
        return await self.receive(plan)


class Observer:
    """Records outputs; ends some requests once they have a given number of tokens (an
    abort, or a deadline's end), from inside the delivery, as the service would."""

    def __init__(self, core: Scheduler, ends: dict[str, tuple[int, ErrorCode]]):
        self.core, self.ends, self.run = core, ends, Run(by_sample=True)
        self.loop: EngineLoop | None = None
        self.max_in_flight = 0
        self.started = self.finished = 0
        self.overlapped = 0  # Plans sent while another was in flight.

    def deliver(self, outputs) -> None:
        self.run.record(outputs)
        for request_id, (num_tokens, code) in list(self.ends.items()):
            got = sum(len(t) for (rid, _), t in self.run.tokens.items() if rid == request_id)
            if got >= num_tokens and self.core.get_request(request_id) is not None:
                del self.ends[request_id]
                ended = (self.core.abort_requests([request_id]) if code is ErrorCode.OK
                         else self.core.fail_requests([request_id], "deadline exceeded", code))
                self.run.record(ended)

    def step_started(self, plan, start_ns):
        self.started += 1
        self.overlapped += bool(self.loop._in_flight)
        self.max_in_flight = max(self.max_in_flight, len(self.loop._in_flight) + 1)

    def step_finished(self, plan, result, span, seconds) -> None:
        self.finished += 1


def run_workload(seed: int, pipelined: bool) -> tuple[dict, dict, Observer]:
    rng = random.Random(seed)
    config, cache, eos = draw_config(rng)
    # NOTE: explicit step budgets, whatever the defaults are (they may follow the device).
    config = dataclasses.replace(config, async_scheduling=pipelined, max_queued_requests=None, max_queued_tokens=None)
    arrivals = [_fitting(a, cache) for a in draw_arrivals(rng, cache.max_model_len)]
    core = Scheduler(config, cache, eos_token_ids=eos)
    token_fn = repeating_token if config.num_speculative_tokens and rng.random() < 0.5 else hash_token
    worker = FakeWorker(cache.block_size, token_fn=token_fn)
    ends = {f"r{rng.randint(0, 11)}": (rng.randint(1, 6), rng.choice([ErrorCode.OK, ErrorCode.DEADLINE_EXCEEDED]))
            for _ in range(rng.randint(0, 3))}
    # NOTE: only of one-sample requests: how far n samples are from each other when one
    # reaches a count depends on the schedule, not only on the tokens.
    several = {a.request_id for a in arrivals if a.n > 1}
    ends = {rid: end for rid, end in ends.items() if rid not in several}
    observer = Observer(core, ends)
    loop = EngineLoop(core, DeferredWorker(worker), observer, asyncio.Event())
    observer.loop = loop
    asyncio.run(_drive(loop, core, arrivals))
    audit = core.audit()
    assert not audit.problems, audit.problems
    assert core.kv.num_free_blocks == core.kv.num_total_blocks, "every block is free at the end"
    assert observer.started == observer.finished, "step_finished once per plan sent"
    return observer.run.tokens, observer.run.finish, observer


def _fitting(arrival: Arrival, cache) -> Arrival:
    """The arrival, with n = 1 if its samples could outgrow the cache together.

    Such a request ends with ERROR (RESOURCE_EXHAUSTED) once its live samples need more
    blocks than the cache has: at a point that depends on how far apart its samples are,
    which the schedule decides, not the tokens (in the serial loop too)."""
    longest = min(len(arrival.prompt) + arrival.sampling.max_tokens, cache.max_model_len)
    blocks = -(-longest // cache.block_size) + 1  # And a copy-on-write.
    return arrival if arrival.n * blocks <= cache.num_blocks else dataclasses.replace(arrival, n=1)


async def _drive(loop: EngineLoop, core: Scheduler, arrivals) -> None:
    count, added, ids = 0, set(), set()
    for _ in range(2000):
        for i, a in enumerate(arrivals):
            if a.step <= count and i not in added:
                added.add(i)
                if a.request_id in ids:
                    continue  # Whether the first is still running then depends on the loop.
                ids.add(a.request_id)
                try:
                    core.add_request(a.request_id, a.prompt, a.sampling, a.n, a.priority)
                except ValueError:
                    pass  # An empty budget, too long: refused either way.
        ran = await loop._step()
        count += 1
        if not ran and len(added) == len(arrivals):
            # Nothing in flight and nothing to plan: what is left (a request no pool
            # this small can hold) would only wait for an abort or a deadline.
            left = [r.request_id for r in core.unfinished_requests()]
            loop.observer.run.record(core.fail_requests(left, "workload over"))
            return
    raise AssertionError("workload not done")


@pytest.mark.parametrize("chunk", range(6))
def test_pipelined_loop_gives_every_request_the_serial_loops_output(chunk):
    overlapped = started = pipelinable = busy = 0
    for seed in range(chunk, NUM_WORKLOADS, 6):
        serial_tokens, serial_finish, serial = run_workload(seed, pipelined=False)
        tokens, finish, pipelined = run_workload(seed, pipelined=True)
        assert tokens == serial_tokens, f"workload {seed}"
        assert finish == serial_finish, f"workload {seed}"
        assert serial.overlapped == 0 and serial.max_in_flight <= 1
        assert pipelined.max_in_flight <= 2
        config = pipelined.loop.core.config
        if config.num_speculative_tokens or config.num_scheduler_steps > 1:
            assert pipelined.overlapped == 0, "drafts and multi-step runs keep the loop serial"
        elif pipelined.started >= 5:
            pipelinable += 1
            busy += pipelined.overlapped >= pipelined.started / 2
            overlapped += pipelined.overlapped
            started += pipelined.started
    # Not vacuous: where the configuration allows it, most plans are built while the one
    # before runs (a step that could preempt, swap or copy-on-write runs serially).
    assert overlapped >= 0.6 * started, f"{overlapped} of {started} plans overlapped"
    assert busy >= 0.75 * pipelinable, f"{busy} of {pipelinable} workloads overlapped in most steps"
