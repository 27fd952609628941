"""The pipelined engine loop's edge cases, one at a time: a sample's last token planned
behind a placeholder, a failed or unsent step with the next plan behind it, an abort
while two plans are in flight, and the steps that must run serially (a possible
preemption, a copy-on-write) - with the guards that catch a plan built wrong."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.contract.outputs import FinishReason
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.scheduler.engine_loop import EngineLoop

from tests.scheduler.scheduler_testkit import FakeWorker, Run, lone_run_tokens, make_scheduler, params
from tests.scheduler.test_pipelined_loop import DeferredWorker


class Recorder:
    """A StepObserver that records outputs and counts plans sent behind another."""

    def __init__(self) -> None:
        self.run = Run(by_sample=True)
        self.loop: EngineLoop | None = None
        self.overlapped = self.started = self.finished = 0
        self.results: list[StepResult] = []

    def deliver(self, outputs) -> None:
        self.run.record(outputs)

    def step_started(self, plan, start_ns):
        self.started += 1
        self.overlapped += bool(self.loop._in_flight)

    def step_finished(self, plan, result, span, seconds) -> None:
        self.finished += 1
        self.results.append(result)


def pipelined(num_blocks: int = 64, worker_cls=DeferredWorker, **config):
    core = make_scheduler(num_blocks, async_scheduling=True, **config)
    worker = worker_cls(FakeWorker(core.cache.block_size))
    recorder = Recorder()
    loop = EngineLoop(core, worker, recorder, asyncio.Event())
    recorder.loop = loop
    return core, loop, recorder


def drain(loop: EngineLoop, max_steps: int = 200) -> None:
    async def go():
        for _ in range(max_steps):
            if not await loop._step():
                return
        raise AssertionError("the loop did not finish")
    asyncio.run(go())


def assert_clean(core, recorder: Recorder) -> None:
    assert not core.has_unfinished_requests()
    assert not core.audit().problems
    assert core.kv.num_free_blocks == core.kv.num_total_blocks
    assert recorder.started == recorder.finished


@pytest.mark.parametrize("max_tokens, max_model_len", [(2, 64), (1, 64), (5, 64), (40, 9)])
def test_the_last_token_planned_behind_a_placeholder_arrives(max_tokens, max_model_len):
    # The reproduction of the drift: the second-to-last token is a placeholder, the
    # last gets none; applying the first used to ignore the sample's last token.
    core, loop, recorder = pipelined(max_model_len=max_model_len)
    prompt = [5, 6, 7, 8, 9]
    core.add_request("a", prompt, params(max_tokens))
    drain(loop)
    want = lone_run_tokens(prompt, max_tokens, eos=10_000)[: max_model_len - len(prompt)]
    assert recorder.run.tokens[("a", 0)] == want
    assert recorder.run.finish[("a", 0)] is FinishReason.LENGTH
    assert recorder.overlapped == len(want) - 1  # Every decode planned while the one before ran.
    assert_clean(core, recorder)


def test_an_abort_with_a_step_in_flight_ignores_its_token_and_frees_the_blocks_at_once():
    core, loop, recorder = pipelined()
    core.add_request("a", [1, 2, 3, 4, 5], params(30))
    core.add_request("b", [9, 8, 7], params(6))

    async def go():
        for _ in range(3):
            await loop._step()
        assert len(loop._in_flight) == 1
        free = core.kv.num_free_blocks
        # The plan in flight samples for it. Delivered as the service does: after the
        # outputs the loop holds.
        loop.deliver(core.abort_requests(["a"]))
        assert core.kv.num_free_blocks > free
        while await loop._step():
            pass
    asyncio.run(go())
    assert recorder.run.finish[("a", 0)] is FinishReason.ABORT
    assert recorder.run.tokens[("a", 0)] == lone_run_tokens([1, 2, 3, 4, 5], 2, eos=10_000)
    assert recorder.run.tokens[("b", 0)] == lone_run_tokens([9, 8, 7], 6, eos=10_000)
    assert_clean(core, recorder)


class FailingWorker(DeferredWorker):
    """Answers step `fail_at` with an error (the next plan is already sent by then)."""

    fail_at = 2

    async def receive(self, plan: StepPlan) -> StepResult:
        result = await super().receive(plan)
        return StepResult(plan.step_id, error="boom") if plan.step_id == self.fail_at else result


def test_a_failed_step_fails_the_plan_sent_behind_it_and_the_loop_goes_on():
    core, loop, recorder = pipelined(worker_cls=FailingWorker)
    core.add_request("a", [1, 2, 3], params(10))
    drain(loop)
    assert recorder.run.finish[("a", 0)] is FinishReason.ERROR
    errors = [r.step_id for r in recorder.results if r.error]
    assert errors == [2, 3], "step 3 was planned on step 2's placeholders"
    assert "followed step 2" in recorder.results[3].error
    core.add_request("b", [4, 5, 6], params(4))  # Served as if nothing had happened.
    drain(loop)
    assert recorder.run.tokens[("b", 0)] == lone_run_tokens([4, 5, 6], 4, eos=10_000)
    assert_clean(core, recorder)


class UnsendableWorker(DeferredWorker):
    """Step `fail_at` cannot be sent (the worker never sees it)."""

    fail_at = 3

    async def send(self, plan: StepPlan) -> None:
        if plan.step_id == self.fail_at:
            raise RuntimeError("cannot encode")
        await super().send(plan)


def test_an_unsent_plan_is_failed_before_anything_is_planned_on_top_of_it():
    core, loop, recorder = pipelined(worker_cls=UnsendableWorker)
    core.add_request("a", [1, 2, 3], params(10))
    drain(loop)
    assert recorder.run.finish[("a", 0)] is FinishReason.ERROR
    assert [r.step_id for r in recorder.results if r.error] == [3]
    assert [r.step_id for r in recorder.results] == [0, 1, 2, 3], "step 2 applied first, nothing after 3"
    assert_clean(core, recorder)


def test_a_step_that_could_preempt_runs_serially():
    # Two requests growing into 3 blocks: the worst case of the next step does not fit.
    core, loop, recorder = pipelined(num_blocks=5, block_size=2, max_model_len=16)
    core.add_request("a", [1, 2, 3], params(8))
    core.add_request("b", [4, 5, 6], params(8))
    drain(loop)
    assert recorder.overlapped < recorder.started - 1
    assert recorder.run.tokens[("a", 0)] == lone_run_tokens([1, 2, 3], 8, eos=10_000)
    assert recorder.run.tokens[("b", 0)] == lone_run_tokens([4, 5, 6], 8, eos=10_000)
    assert core.stats().num_preemptions > 0, "the workload preempts (in serial steps)"
    assert_clean(core, recorder)


def test_preempting_a_sample_with_a_step_in_flight_is_refused():
    core = make_scheduler(16, async_scheduling=True)
    core.add_request("a", [1, 2, 3], params(8))
    core.schedule()  # In flight: it samples a's first token.
    with pytest.raises(RuntimeError, match="while a step samples for it"):
        core.policy.preemptor.preempt(core.get_request("a"))
    assert core.get_request("a").samples[0] in core.queues.running, "nothing moved"


def test_forked_samples_writing_a_shared_block_wait_for_the_real_tokens():
    # n = 2 with prompt[:-1] ending mid-block: both samples copy-on-write that block.
    core = make_scheduler(32, async_scheduling=True)
    worker = FakeWorker(core.cache.block_size)
    core.add_request("r", [1, 2, 3, 4, 5, 6], params(4), n=2)
    plan = core.schedule()
    core.update_from_output(plan, worker.execute(plan))  # The root prefilled: forked.
    assert not core.can_schedule_ahead(plan), "a copy-on-write must see the real tokens"
    plan = core.schedule()
    assert core.can_schedule_ahead(plan), "each sample now writes its own block"


class LoggingWorker(DeferredWorker):
    """A DeferredWorker that logs each plan it is sent."""

    def __init__(self, worker: FakeWorker):
        super().__init__(worker)
        self.log: list[tuple] = []

    async def send(self, plan: StepPlan) -> None:
        await super().send(plan)
        self.log.append(("sent", plan.step_id))


def test_a_steps_outputs_go_out_once_the_plan_after_next_is_sent_and_before_anything_else():
    core, loop, recorder = pipelined(worker_cls=LoggingWorker)
    log = loop.worker.log
    delivered = recorder.deliver
    recorder.deliver = lambda outputs: (log.append(("delivered", [o.new_token_ids[0] for o in outputs
                                                                  if o.new_token_ids])), delivered(outputs))
    core.add_request("a", [1, 2, 3, 4, 5], params(4))
    drain(loop)
    tokens = recorder.run.tokens[("a", 0)]
    assert tokens == lone_run_tokens([1, 2, 3, 4, 5], 4, eos=10_000)
    # Step k samples token k; its output is delivered once plan k + 2 is written: the
    # only host work between a result and the next plan is the update.
    sent_then_delivered = [event for event in log if event[0] == "sent" or event[1]]
    assert sent_then_delivered == [("sent", 0), ("sent", 1), ("sent", 2), ("delivered", [tokens[0]]),
                                   ("sent", 3), ("delivered", [tokens[1]]),
                                   ("delivered", [tokens[2]]), ("delivered", [tokens[3]])]
    assert_clean(core, recorder)


def test_what_the_owner_delivers_goes_after_the_outputs_the_loop_holds():
    core, loop, recorder = pipelined()
    core.add_request("a", [1, 2, 3, 4, 5], params(30))

    async def go():
        for _ in range(3):
            await loop._step()
        assert loop._held, "step 0's output waits for the plan after next"
        held = list(loop._held)
        loop.deliver(core.abort_requests(["a"]))
        assert recorder.run.outputs[-2:-1] == held and recorder.run.finish[("a", 0)] is FinishReason.ABORT
        assert loop._held is None
        while await loop._step():
            pass
    asyncio.run(go())
    assert_clean(core, recorder)
