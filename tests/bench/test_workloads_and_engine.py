"""The benchmark's workload generator, and the in-process engine it measures with the
step records it takes around it."""

from __future__ import annotations

import pytest

from llmserve.bench.step_records import RecordingEngine
from llmserve.bench.workloads import random_workload, reference_workload, summary
from llmserve.contract.sampling import SamplingParams


def test_reference_workload_is_the_documented_one():
    # shared/NOTES.md: 64 requests, 8,731 prompt and 4,649 output tokens.
    assert summary(reference_workload(49152)) == {"num_requests": 64, "prompt_tokens": 8731,
                                                  "output_tokens": 4649}


def test_random_workload_respects_ranges_and_seed():
    a = random_workload(50, (3, 9), (1, 4), vocab_size=100, seed=5)
    assert a == random_workload(50, (3, 9), (1, 4), vocab_size=100, seed=5)
    assert a != random_workload(50, (3, 9), (1, 4), vocab_size=100, seed=6)
    assert all(3 <= len(r.prompt_token_ids) <= 9 and 1 <= r.output_len <= 4 for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt_token_ids)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return RecordingEngine.from_model_dir(tiny_llama_dir, num_kv_blocks=6, max_num_batched_tokens=64)


def test_in_process_engine_runs_a_workload_to_completion_under_a_tiny_cache(engine):
    requests = random_workload(6, (5, 20), (8, 24), vocab_size=256, seed=1)
    big = RecordingEngine.from_model_dir(engine.runner.model_dir, num_kv_blocks=200)
    args = [(f"r{i}", r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                         ignore_eos=True)) for i, r in enumerate(requests)]
    small_out = engine.run(args)
    big_out = big.run(args)
    assert {k: v.output_token_ids for k, v in small_out.items()} == {k: v.output_token_ids for k, v in big_out.items()}
    assert all(len(small_out[f"r{i}"].output_token_ids) == r.output_len for i, r in enumerate(requests))
    assert engine.scheduler.stats().num_preemptions > 0
    assert engine.scheduler.stats().num_free_blocks == 6
    # Every step recorded live tokens within the slots its blocks provide.
    assert all(s.live_tokens <= s.allocated_slots for s in engine.steps)
    assert max(s.live_tokens for s in engine.steps) > 16


def test_a_multi_step_plan_is_recorded_as_the_decode_steps_it_ran(tiny_llama_dir):
    engine = RecordingEngine.from_model_dir(tiny_llama_dir, num_kv_blocks=20, num_scheduler_steps=4)
    out = engine.run([("a", list(range(3, 23)), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))])
    assert len(out["a"].output_token_ids) == 9
    prefill, *decodes = engine.steps
    # The 20-token prompt (causal pairs 20 * 21 / 2), then one step per further token.
    assert (prefill.num_scheduled_tokens, prefill.attention_pairs, prefill.kv_tokens_read) == (20, 210, 0)
    assert len(decodes) == 8 and sum(s.num_sampled for s in engine.steps) == 9
    # Each step of a run reads a context one token longer than the step before.
    assert [s.kv_tokens_read for s in decodes] == list(range(20, 28))
    assert [s.attention_pairs for s in decodes] == list(range(21, 29))
    assert all((s.num_seqs, s.num_scheduled_tokens) == (1, 1) for s in decodes)
    # Fewer plans than steps: a run's steps share its time equally.
    assert len({s.seconds for s in decodes}) < 8
