"""ModelRunner driven by StepPlans vs HF greedy generation, preemption, validation."""

from __future__ import annotations

import pytest

from llmserve.contract.plan import CachedRequestData, NewRequestData, StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.config import RunnerConfig

from .conftest import PlanDriver, hf_greedy

BLOCK = 4
NUM_BLOCKS = 80
GEN = 20
PROMPTS = {
    "a": [11, 45, 3, 99, 120, 7, 8, 250],
    "b": list(range(20, 43)),  # 23 tokens, prefilled in two chunks
    "c": [5, 17, 230, 4, 60],  # arrives mid-way
}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    out = hf_greedy(tiny_llama_dir, PROMPTS, GEN)
    assert all(len(v) == GEN for v in out.values())
    return out


def _runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_model_len=128, swap_space=0))


def test_info(tiny_llama_dir):
    info = _runner(tiny_llama_dir).info
    assert (info.num_kv_blocks, info.block_size, info.max_model_len) == (NUM_BLOCKS, BLOCK, 128)
    assert (info.vocab_size, info.eos_token_ids, info.bos_token_id, info.dtype) == (300, (2,), 1, "float32")


def test_greedy_concurrent_requests_match_hf_generate(tiny_llama_dir, reference):
    d = PlanDriver(_runner(tiny_llama_dir), BLOCK, NUM_BLOCKS)
    for rid, p in PROMPTS.items():
        d.add(rid, p)
    r0 = d.step({"a": None, "b": 10})
    assert [d.name(s.seq_id) for s in r0.sampled] == ["a"]  # b's partial chunk samples nothing
    d.step({"a": 1, "b": None})
    for _ in range(3):
        d.step({"a": 1, "b": 1})
    d.step({"a": 1, "b": 1, "c": None})  # c arrives mid-way
    while any(len(d.outputs(r)) < GEN for r in PROMPTS):
        d.step({r: 1 for r in PROMPTS if len(d.outputs(r)) < GEN})
    for rid in PROMPTS:
        assert d.outputs(rid) == reference[rid], rid


def test_preempted_request_recomputes_identically(tiny_llama_dir, reference):
    d = PlanDriver(_runner(tiny_llama_dir), BLOCK, NUM_BLOCKS, seed=3)
    d.add("a", PROMPTS["a"])
    d.add("b", PROMPTS["b"])
    d.step({"a": None, "b": None})
    for _ in range(6):
        d.step({"a": 1, "b": 1})
    finished = d.preempt("a")  # dropped from the worker, blocks freed
    d.step({"b": 1}, finished=finished)
    assert "a" not in d.runner.batch.states
    d.step({"a": None, "b": 1})  # re-sent in full: prompt + 7 generated tokens
    while any(len(d.outputs(r)) < GEN for r in ("a", "b")):
        d.step({r: 1 for r in ("a", "b") if len(d.outputs(r)) < GEN})
    assert d.outputs("a") == reference["a"]
    assert d.outputs("b") == reference["b"]


def test_bad_plans_raise_and_leave_state(tiny_llama_dir):
    runner = _runner(tiny_llama_dir)
    g = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(0, new_requests=[NewRequestData(1, [1, 2, 3], 3, g, [0], 0, 3)]))
    bad = [
        StepPlan(1, cached_requests=[CachedRequestData(999, [], 3, 1)]),
        StepPlan(1, cached_requests=[CachedRequestData(1, [NUM_BLOCKS], 3, 1)]),
        StepPlan(1, new_requests=[NewRequestData(2, list(range(9)), 9, g, [1, 2], 0, 9)]),
        StepPlan(1, cached_requests=[CachedRequestData(1, [], 3, 2)]),  # only 4 tokens known
    ]
    for plan in bad:
        with pytest.raises(ValueError):
            runner.execute(plan)
    assert runner.batch.states[1].block_ids == [0]
    out = runner.execute(StepPlan(2, cached_requests=[CachedRequestData(1, [5], 3, 1)]))
    assert len(out.sampled) == 1 and runner.batch.states[1].block_ids == [0, 5]
    runner.reset_requests()
    with pytest.raises(ValueError, match="unknown"):
        runner.execute(StepPlan(3, cached_requests=[CachedRequestData(1, [], 4, 1)]))


def test_reset_after_the_block_tables_grew_inside_a_step(tiny_llama_dir):
    """70 requests in one plan grow the block tables past their 64 rows inside the step
    (inference mode); reset_requests then zeroes them outside it (a new scheduler stream,
    a bench's next batch size): the first GPU run failed there ("Inplace update to
    inference tensor outside InferenceMode")."""
    runner = _runner(tiny_llama_dir)
    g = SamplingParams(temperature=0.0)
    many = [NewRequestData(i, [3 + i], 1, g, [i], 0, 1) for i in range(70)]
    assert len(runner.execute(StepPlan(0, new_requests=many)).sampled) == 70
    runner.reset_requests()
    assert not runner.batch.states and not runner.batch.block_tables.table.any()
    out = runner.execute(StepPlan(1, new_requests=[NewRequestData(1, [1, 2, 3], 3, g, [0], 0, 3)]))
    assert len(out.sampled) == 1


def test_seeded_sampling_survives_batching_and_preemption(tiny_llama_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    solo = PlanDriver(_runner(tiny_llama_dir), BLOCK, NUM_BLOCKS)
    solo.add("s", PROMPTS["a"], seeded)
    solo.step({"s": None})
    while len(solo.outputs("s")) < 12:
        solo.step({"s": 1})

    busy = PlanDriver(_runner(tiny_llama_dir), BLOCK, NUM_BLOCKS, seed=5)
    busy.add("s", PROMPTS["a"], seeded)
    busy.add("o", PROMPTS["b"], SamplingParams(temperature=1.0))
    busy.step({"s": None, "o": None})
    for _ in range(4):
        busy.step({"s": 1, "o": 1})
    busy.step({"o": 1}, finished=busy.preempt("s"))
    busy.step({"s": None, "o": 1})
    while len(busy.outputs("s")) < 12:
        busy.step({"s": 1, "o": 1})
    assert busy.outputs("s") == solo.outputs("s")
    assert len(set(solo.outputs("s"))) > 3  # really sampled, not stuck on one token


def test_a_runner_can_share_another_runners_weights(tiny_llama_dir, reference):
    first = _runner(tiny_llama_dir)
    second = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=BLOCK, num_kv_blocks=24, max_model_len=128, swap_space=0), model=first.model)
    assert second.model is first.model and second.num_kv_blocks == 24
    assert second.kv_caches[0].data_ptr() != first.kv_caches[0].data_ptr()  # its own KV cache
    d = PlanDriver(second, BLOCK, 24)
    d.add("a", PROMPTS["a"])
    d.step({"a": None})
    while len(d.outputs("a")) < GEN:
        d.step({"a": 1})
    assert d.outputs("a") == reference["a"]
