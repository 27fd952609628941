"""The engine loop cannot die from a request: a step that cannot be sent, or whose result
cannot be applied, fails the requests of that step (by their public ids, freeing their
blocks) and the loop goes on; an error no request can be blamed for halts the engine:
run() raises EngineHalted to the engine session, never silently."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.contract.outputs import ErrorCode, FinishReason, RequestOutput
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.scheduler.engine_loop import EngineHalted, EngineLoop
from llmserve.scheduler.worker_link import WorkerLost

from .scheduler_testkit import FakeWorker, make_scheduler, params


class ScriptedWorker:
    """A FakeWorker behind an async execute; `fail(plan)` may raise instead."""

    def __init__(self, fail=lambda plan: None):
        self.fake = FakeWorker(4)
        self.fail = fail
        self.plans: list[StepPlan] = []

    def interrupt(self) -> None:  # No multi-step plans here.
        pass

    async def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.fail(plan)
        return self.fake.execute(plan)


class Harness:
    """An EngineLoop over a test core; it is the loop's StepObserver and keeps every
    output delivered, and the steps started and finished (by step id)."""

    def __init__(self, worker, **config):
        self.core = make_scheduler(**config)
        self.outputs: list[RequestOutput] = []
        self.started: list[int] = []
        self.finished: list[int] = []
        self.work = asyncio.Event()
        self.loop = EngineLoop(self.core, worker, self, self.work)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self.outputs += outputs

    def step_started(self, plan: StepPlan, start_ns: int) -> None:
        self.started.append(plan.step_id)

    def step_finished(self, plan: StepPlan, result: StepResult, span, seconds: float) -> None:
        assert span is None and seconds >= 0
        self.finished.append(plan.step_id)

    def add(self, request_id: str, n: int = 1, max_tokens: int = 3) -> None:
        self.core.add_request(request_id, [1, 2, 3, 4, 5], params(max_tokens=max_tokens), n=n)
        self.work.set()

    def ends(self) -> dict[tuple[str, int], RequestOutput]:
        return {(o.request_id, o.index): o for o in self.outputs if o.finished}

    async def run_until_idle(self, timeout: float = 5.0) -> None:
        task = asyncio.create_task(self.loop.run())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.core.has_unfinished_requests() and not task.done():
            assert loop.time() < deadline, "the engine loop made no progress"
            await asyncio.sleep(0.001)
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def assert_no_blocks_held(self) -> None:
        audit = self.core.audit()
        assert audit.ok, audit.problems
        assert self.core.stats().num_free_blocks == self.core.stats().num_total_blocks


def fail_when(request_id: str, core_of, exc: Exception):
    """Raise `exc` for any plan that schedules a sample of `request_id`."""
    def fail(plan: StepPlan) -> None:
        core = core_of()
        for row in plan.new_requests + plan.cached_requests:
            sample = core.get_sample(row.seq_id)
            if sample is not None and sample.request.request_id == request_id:
                raise exc
    return fail


async def test_a_step_that_cannot_be_sent_fails_its_requests_and_the_loop_goes_on():
    h = None
    worker = ScriptedWorker(fail_when("bad", lambda: h.core, ValueError("Value out of range: 9223372036854775808")))
    h = Harness(worker)
    h.add("good-before")
    await h.run_until_idle()
    h.add("bad", n=2)  # Its root and samples: the public id must end, not the sequence ids.
    await h.run_until_idle()
    h.add("good-after")
    await h.run_until_idle()
    ends = h.ends()
    assert ends[("good-before", 0)].finish_reason == FinishReason.LENGTH
    assert ends[("good-after", 0)].finish_reason == FinishReason.LENGTH
    for index in (0, 1):
        bad = ends[("bad", index)]
        assert bad.finish_reason == FinishReason.ERROR and bad.error_code == ErrorCode.INTERNAL
        assert "could not be sent" in bad.error and "Value out of range" in bad.error
    assert h.loop.num_failed_steps == 1
    # The failed step still started and finished: its span ends, its time is counted.
    assert h.started == h.finished and len(h.started) >= 3
    h.assert_no_blocks_held()


async def test_a_result_that_cannot_be_applied_fails_that_steps_requests_by_public_id():
    worker = ScriptedWorker()
    h = Harness(worker)
    output = h.core.outputs._output  # (every path that applies a sample's tokens ends there)

    def broken_for_x(sample, *args):
        if sample.request.request_id == "x":
            raise KeyError("a bug while applying x's tokens")
        return output(sample, *args)

    h.core.outputs._output = broken_for_x
    h.add("x", n=2)
    await h.run_until_idle()
    h.add("y")
    await h.run_until_idle()
    ends = h.ends()
    assert {ends[("x", i)].finish_reason for i in (0, 1)} == {FinishReason.ERROR}
    assert "internal scheduler error" in ends[("x", 0)].error
    assert ends[("y", 0)].finish_reason == FinishReason.LENGTH
    h.assert_no_blocks_held()


async def test_a_failed_send_tells_the_worker_again_what_the_plan_dropped():
    h = None
    worker = ScriptedWorker(fail_when("bad", lambda: h.core, RuntimeError("encode failed")))
    h = Harness(worker, max_num_seqs=1)
    h.add("a", max_tokens=1)
    a_seq = h.core.get_request("a").samples[0].seq_id
    h.add("bad")
    h.add("c", max_tokens=2)
    await h.run_until_idle()
    # The plan that dropped a (it had finished) scheduled "bad" and never reached the
    # worker; a later plan carries the drop again.
    assert any(a_seq in p.finished_seq_ids and h.core.get_sample(p.new_requests[0].seq_id) is None
               for p in worker.plans if p.new_requests)
    assert a_seq not in worker.fake.requests
    assert h.ends()[("c", 0)].finish_reason == FinishReason.LENGTH


async def test_an_error_in_building_a_step_halts_the_engine():
    h = Harness(ScriptedWorker())

    def broken_schedule():
        raise AssertionError("queues out of order")

    h.core.schedule = broken_schedule
    h.add("a")
    with pytest.raises(EngineHalted) as halted:
        await asyncio.wait_for(h.loop.run(), 5)
    # The reason names what failed and why: "EngineHalted: building step failed: ...".
    assert str(halted.value) == "EngineHalted: building step failed: queues out of order"
    assert not h.started


async def test_a_lost_worker_ends_the_loop_with_worker_lost():
    async def lost(plan):
        raise WorkerLost("worker w: UNAVAILABLE")

    worker = ScriptedWorker()
    worker.execute = lost
    h = Harness(worker)
    h.add("a")
    with pytest.raises(WorkerLost, match="^worker w: UNAVAILABLE$"):
        await asyncio.wait_for(h.loop.run(), 5)
    assert h.started == [0] and not h.finished and not h.outputs  # The request is the session's to fail.


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 2**63 - 2])
async def test_seeds_derived_per_sample_fit_the_worker_wire(seed):
    """Finding 1: seed 2**63 - 1 with n = 2 gave sample 1 the seed 2**63 and killed the loop."""
    from llmserve.contract import wire

    sent = []

    async def encode(plan):
        sent.append(wire.plan_command_to_pb(plan))  # Raises ValueError if a field overflows.
        return worker.fake.execute(plan)

    worker = ScriptedWorker()
    worker.execute = encode
    h = Harness(worker)
    h.core.add_request("s", [1, 2, 3, 4, 5], params(max_tokens=2, seed=seed, temperature=1.0), n=3)
    h.work.set()
    await h.run_until_idle()
    ends = h.ends()
    assert {ends[("s", i)].finish_reason for i in range(3)} == {FinishReason.LENGTH}
    seeds = {r.sampling.seed for command in sent for r in command.plan.new_requests}
    assert all(-(2**63) <= s < 2**63 for s in seeds) and len(seeds) >= 3


async def test_a_halted_engine_fails_live_requests_turns_not_serving_and_refuses_new_ones():
    """The service's side of a halt: never a silent hang with SERVING."""
    from llmserve.contract import wire
    from llmserve.contract.grpc_server import NOT_SERVING, ServiceServer
    from llmserve.internal.v1 import scheduler_pb2
    from llmserve.scheduler.config import SchedulerServiceConfig
    from llmserve.scheduler.engine_session import EngineState
    from llmserve.scheduler.routers import RouterSession
    from llmserve.scheduler.service import SchedulerServicer
    from llmserve.contract.sampling import SamplingParams
    from llmserve.contract.security import SecurityOptions

    server = ServiceServer("llmserve.internal.v1.Scheduler", "127.0.0.1", 0, SecurityOptions(insecure=True))
    servicer = SchedulerServicer(SchedulerServiceConfig(), server)
    engine = servicer.new_engine(make_scheduler(), ScriptedWorker())
    await server.set_serving(True)

    def broken_schedule():
        raise IndexError("a bug in the policy")

    engine.core.schedule = broken_schedule
    loop_task = engine.start_loop()
    session = RouterSession()
    add = wire.add_request_to_pb("r", [1, 2, 3], SamplingParams(max_tokens=4), n=2)
    servicer.add(session, add)
    await asyncio.wait_for(loop_task, 5)
    outputs = []
    while not session.updates.empty():
        outputs += (await session.next_update()).outputs
    assert sorted(o.index for o in outputs) == [0, 1]
    assert all(o.error_code == ErrorCode.UNAVAILABLE and "a bug in the policy" in o.error for o in outputs)
    assert (await server.health.Check(_health_request(), None)).status == NOT_SERVING
    assert not engine.core.has_unfinished_requests() and engine.state is EngineState.HALTED
    assert engine.halted == "EngineHalted: building step failed: a bug in the policy"
    servicer.add(session, wire.add_request_to_pb("later", [1, 2], SamplingParams(max_tokens=2)))
    [refused] = (await session.next_update()).outputs
    assert refused.error_code == ErrorCode.UNAVAILABLE and "engine halted" in refused.error
    assert isinstance(refused, scheduler_pb2.RequestOutput)


def _health_request():
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckRequest(service="")
