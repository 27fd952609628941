"""Multi-step plans on the real ModelRunner: the tokens of single steps (HF's greedy ones),
seeded sampling unchanged, interrupts between steps, and the interrupt over the Execute
stream."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.config import RunnerConfig

from .conftest import PlanDriver, hf_greedy

BLOCK = 4
NUM_BLOCKS = 120
GEN = 24
PROMPTS = {"a": [11, 45, 3, 99, 120, 7, 8, 250], "b": list(range(20, 43))}


def _runner(model_dir, max_model_len: int = 128) -> ModelRunner:
    return ModelRunner(model_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_model_len=max_model_len, swap_space=0))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, GEN)


def test_runs_of_decode_steps_give_hf_greedy_tokens(tiny_llama_dir, reference):
    d = PlanDriver(_runner(tiny_llama_dir), BLOCK, NUM_BLOCKS)
    for rid, prompt in PROMPTS.items():
        d.add(rid, prompt)
    d.step({"a": None, "b": None})
    for num_steps in (5, 1, 3, 7, 2, 5):  # 1 + 23 tokens
        result = d.step({"a": 1, "b": 1}, num_steps=num_steps)
        assert result.num_steps == num_steps
        # Step by step: every request once per step, in plan order.
        assert [d.name(s.seq_id) for s in result.sampled] == ["a", "b"] * num_steps
    for rid in PROMPTS:
        assert d.outputs(rid) == reference[rid], rid


def test_seeded_sampling_in_a_run_matches_single_steps(tiny_llama_dir):
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=11, logprobs=2)
    outputs, logprobs = {}, {}
    for num_steps in (1, 6):
        d = PlanDriver(_runner(tiny_llama_dir), BLOCK, NUM_BLOCKS)
        d.add("s", PROMPTS["a"], seeded)
        d.step({"s": None})
        lps = []
        while len(d.outputs("s")) < 13:
            lps += [s.logprobs for s in d.step({"s": 1}, num_steps=num_steps).sampled]
        outputs[num_steps], logprobs[num_steps] = d.outputs("s"), lps
    assert outputs[6] == outputs[1] and len(set(outputs[1])) > 3
    assert [lp.token_id for lp in logprobs[6]] == outputs[6][1:]
    assert [lp.top_token_ids for lp in logprobs[6]] == [lp.top_token_ids for lp in logprobs[1]]


def test_an_interrupt_ends_the_run_after_its_current_step(tiny_llama_dir, reference):
    d = PlanDriver(_runner(tiny_llama_dir), BLOCK, NUM_BLOCKS)
    d.add("a", PROMPTS["a"])
    d.step({"a": None})
    d.runner.interrupt(d.step_id + 5)  # another plan's: ignored
    assert d.step({"a": 1}, num_steps=4).num_steps == 4
    d.runner.interrupt(d.step_id)  # this plan's, before it starts: one step runs
    assert d.step({"a": 1}, num_steps=4).num_steps == 1
    while len(d.outputs("a")) < GEN:
        d.step({"a": 1}, num_steps=min(3, GEN - len(d.outputs("a"))))
    assert d.outputs("a") == reference["a"]


def test_multi_step_plans_that_cannot_run_are_refused(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, max_model_len=16)
    g = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(0, new_requests=[NewRequestData(1, [1, 2, 3], 3, g, [0], 0, 3)]))
    bad = [
        StepPlan(1, new_requests=[NewRequestData(3, [1, 2, 3], 3, g, [1, 2], 0, 3)], num_steps=2),  # a prompt
        StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 1)], num_steps=3),  # slots 3..5: 2 blocks
        StepPlan(1, cached_requests=[CachedRequestData(1, [1, 2, 3, 4], 3, 1)], num_steps=14),  # past 16
        StepPlan(1, cached_requests=[CachedRequestData(1, [1], 3, 1)], num_steps=0),
    ]
    for plan in bad:
        with pytest.raises(ValueError):
            runner.execute(plan)
    assert runner.batch.states[1].block_ids == [0] and len(runner.batch.states[1].token_ids) == 4
    result = runner.execute(StepPlan(2, cached_requests=[CachedRequestData(1, [1], 3, 1)], num_steps=5))
    assert result.num_steps == 5 and len(runner.batch.states[1].token_ids) == 9


def test_an_interrupt_over_the_execute_stream_cuts_a_long_run(tiny_llama_dir):
    """The worker reads its stream while a run goes on: the scheduler's interrupt lands
    between two steps, and the stream carries on with the next plan."""
    from llmserve.contract.grpc_server import ServiceServer
    from llmserve.contract.security import SecurityOptions
    from llmserve.internal.v1 import worker_pb2_grpc
    from llmserve.scheduler.worker_link import WorkerLink
    from llmserve.worker import service

    plaintext = SecurityOptions(insecure=True)  # In-process: the stream is the point, not TLS.

    async def run():
        config = service.WorkerConfig(model=str(tiny_llama_dir), served_model_name="tiny", runner=RunnerConfig(num_kv_blocks=NUM_BLOCKS,
                                      max_num_batched_tokens=64, swap_space=0), security=plaintext)
        servicer = await service.load_servicer(config)
        server = ServiceServer("llmserve.internal.v1.Worker", "127.0.0.1", 0, plaintext)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server.server)
        await server.start()
        link = WorkerLink(f"127.0.0.1:{server.port}", servicer.runner.info, plaintext)
        try:
            g = SamplingParams(temperature=0.0)
            prefill = await link.execute(StepPlan(0, new_requests=[
                NewRequestData(1, [1, 2, 3], 3, g, list(range(100)), 0, 3)]))
            long_run = StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 1)], num_steps=200)
            pending = asyncio.ensure_future(link.execute(long_run))
            while link._interruptible is None:  # the plan is written
                await asyncio.sleep(0.001)
            link.interrupt()
            cut = await pending
            after = await link.execute(StepPlan(2, cached_requests=[
                CachedRequestData(1, [], 3 + cut.num_steps, 1)], num_steps=2))
            return prefill, cut, after
        finally:
            await link.close()
            await server.stop(grace=None)

    prefill, cut, after = asyncio.run(run())
    assert prefill.error == "" and cut.error == "" and after.error == ""
    assert 1 <= cut.num_steps < 200 and len(cut.sampled) == cut.num_steps
    assert after.num_steps == 2 and len(after.sampled) == 2
