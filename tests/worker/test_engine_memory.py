"""The whole engine (scheduler + model runner) under memory pressure: greedy outputs equal
HF transformers whatever the cache size, preemption mode, prefix caching or token budget;
prefix hits skip computation; n samples share their prompt blocks."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.launcher.engine import InProcessEngine
from llmserve.contract.sampling import SamplingParams
from llmserve.worker import kv_cache as kvc

from .conftest import hf_greedy

GEN = 12
SWAP_BYTES = 64 * kvc.bytes_per_block(16, 2, 16, 3, torch.float32)
rng = random.Random(4)
PROMPTS = {f"r{i}": [rng.randrange(3, 300) for _ in range(n)] for i, n in enumerate([20, 35, 9, 41, 17, 28])}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, GEN)


def greedy(max_tokens=GEN, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def executed_plans(engine) -> list:
    """The plans the engine's runner runs from now on, in order (executed, or launched
    where the engine loop is pipelined)."""
    name = "launch" if engine.pipelined else "execute"
    plans, run_plan = [], getattr(engine.runner, name)

    def record(plan):
        plans.append(plan)
        return run_plan(plan)

    setattr(engine.runner, name, record)
    return plans


def run(engine, prompts=PROMPTS, sampling=None):
    out = engine.run([(rid, p, sampling or greedy()) for rid, p in prompts.items()])
    return {rid: c.output_token_ids for rid, c in out.items()}


CONFIGS = {
    "large": dict(num_kv_blocks=200),
    "tiny-swap": dict(num_kv_blocks=7, swap_space=SWAP_BYTES, preemption_mode="swap"),
    "tiny-recompute": dict(num_kv_blocks=7, preemption_mode="recompute"),
    "no-prefix-caching": dict(num_kv_blocks=7, enable_prefix_caching=False),
    "chunked-8": dict(num_kv_blocks=7, max_num_batched_tokens=8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_match_hf_under_every_memory_setting(tiny_llama_dir, reference, name):
    engine = InProcessEngine.from_model_dir(tiny_llama_dir, **CONFIGS[name])
    plans = executed_plans(engine)
    assert run(engine) == reference
    stats = engine.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    if name == "tiny-swap":
        assert stats.num_preemptions_swap > 0 and stats.num_swapped_out_blocks > 0
    if name in ("tiny-recompute", "no-prefix-caching"):
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    if name == "chunked-8":
        assert max(p.total_scheduled_tokens for p in plans) <= 8
        # A long prompt is split, and decodes of other requests share its steps.
        assert any(len(p.new_requests) + len(p.cached_requests) > 1 and
                   any(r.num_scheduled_tokens > 1 for r in p.new_requests + p.cached_requests)
                   for p in plans)


def test_greedy_samples_under_swap_pressure_match_hf(tiny_llama_dir, reference):
    engine = InProcessEngine.from_model_dir(tiny_llama_dir, num_kv_blocks=9, swap_space=SWAP_BYTES)
    outputs: dict[tuple[str, int], list[int]] = {}
    for rid in ("r1", "r3"):
        engine.add_request(rid, PROMPTS[rid], greedy(), n=3)
    while engine.scheduler.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    assert outputs == {(rid, i): reference[rid] for rid in ("r1", "r3") for i in range(3)}
    assert engine.scheduler.stats().num_preemptions_swap > 0  # Several samples: swapped (auto).


def computed_tokens(plans):
    """Tokens the worker was asked to compute by these plans."""
    return sum(r.num_scheduled_tokens for p in plans for r in p.new_requests + p.cached_requests)


def test_shared_200_token_prefix_is_computed_once(tiny_llama_dir):
    prefix = [rng.randrange(3, 300) for _ in range(200)]
    first, second = prefix + [5, 6, 7], prefix + [8, 9, 10, 11, 12]
    uncached = InProcessEngine.from_model_dir(tiny_llama_dir, num_kv_blocks=60, enable_prefix_caching=False)
    expected = run(uncached, {"b": second}, greedy(8))
    engine = InProcessEngine.from_model_dir(tiny_llama_dir, num_kv_blocks=60)
    plans = executed_plans(engine)
    run(engine, {"a": first}, greedy(8))
    num_plans_of_a = len(plans)
    seen = []
    out = engine.run([("b", second, greedy(8))], on_output=seen.append)
    assert out["b"].output_token_ids == expected["b"]
    assert all(o.num_cached_tokens == 192 for o in seen)  # 12 full blocks of 16.
    assert computed_tokens(plans[num_plans_of_a:]) == len(second) - 192 + 7  # new prompt tokens + 7 decodes
    stats = engine.scheduler.stats()
    assert stats.prefix_cache_hits == 192 and stats.prefix_cache_queries == len(first) + len(second)


def test_n_samples_differ_share_prompt_blocks_and_replay_alone(tiny_llama_dir):
    prompt, n, seed = PROMPTS["r1"] + [7, 8], 4, 11  # 37 tokens: the root prefills 36 (3 blocks).
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
    engine = InProcessEngine.from_model_dir(tiny_llama_dir, num_kv_blocks=60, enable_prefix_caching=False)
    samples: dict[int, list[int]] = {}
    engine.add_request("g", prompt, sampling, n=n)
    while engine.scheduler.has_unfinished_requests():
        for out in engine.step():
            samples.setdefault(out.index, []).extend(out.new_token_ids)
    assert sorted(samples) == list(range(n)) and all(len(s) == 10 for s in samples.values())
    assert len({tuple(s) for s in samples.values()}) == n
    stats = engine.scheduler.stats()
    # 3 prompt blocks once; the shared partial block 2 is copied for 3 samples, the 4th
    # writes in place; 46 tokens fit in 3 blocks, so nothing else is allocated.
    assert (stats.num_allocated_blocks, stats.num_cow_copies) == (3 + 3, 3)
    for i in range(n):
        alone = InProcessEngine.from_model_dir(tiny_llama_dir, num_kv_blocks=60)
        from dataclasses import replace
        out = alone.run([("x", prompt, replace(sampling, seed=seed + i))])
        assert out["x"].output_token_ids == samples[i], i
