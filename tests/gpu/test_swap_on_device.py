"""Preemption by swap and copy-on-write through the whole engine on the device: a KV cache
too small for the batch swaps requests out to the pinned host pool and back (asynchronous
copies on the mover's side stream), samples of one prompt share its blocks and copy the
partial one on write; the greedy tokens are those of an engine that never preempts, and
seeded top-k / top-p samples (the Triton filter, per-row device generators) those of each
sample run alone. (The block moves themselves: tests/worker/test_block_moves.py.)"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from llmserve.contract.sampling import SamplingParams
from llmserve.launcher.engine import InProcessEngine
from llmserve.worker import kv_cache as kvc

from .conftest import DEVICE, GPU, ON_CUDA

pytestmark = GPU

GEN = 12
BLOCK = 16  # NOTE: the Triton prefill kernel takes blocks of 16 tokens or more
SWAP_BYTES = 64 * kvc.bytes_per_block(BLOCK, 2, 16, 3, torch.float32)
_rng = random.Random(4)
PROMPTS = {f"r{i}": [_rng.randrange(3, 300) for _ in range(n)] for i, n in enumerate([20, 35, 9, 41, 17, 28])}


def _engine(model_dir, **settings) -> InProcessEngine:
    engine = InProcessEngine.from_model_dir(model_dir, device=DEVICE.type, dtype="float32", block_size=BLOCK,
                                            max_num_seqs=8, **settings)
    assert all(c.device.type == DEVICE.type for c in engine.runner.kv_caches)
    if ON_CUDA and engine.runner.num_cpu_blocks:
        assert all(c.is_pinned() for c in engine.runner.cpu_kv_caches) and engine.runner.mover.stream is not None
    return engine


def _greedy(max_tokens: int = GEN) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _samples(engine: InProcessEngine, requests: dict[str, tuple[list[int], SamplingParams, int]]):
    """(request, sample index) -> tokens, every request added at once."""
    for rid, (prompt, sampling, n) in requests.items():
        engine.add_request(rid, prompt, sampling, n=n)
    out: dict[tuple[str, int], list[int]] = {}
    while engine.scheduler.has_unfinished_requests():
        for o in engine.step():
            out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    return out


def _all_blocks_free(engine: InProcessEngine) -> bool:
    stats = engine.scheduler.stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_free_cpu_blocks == stats.num_cpu_blocks


def test_preemption_by_swap_gives_the_tokens_of_no_preemption(tiny_llama_dir):
    requests = {rid: (p, _greedy(), 1) for rid, p in PROMPTS.items()}
    want = _samples(_engine(tiny_llama_dir, num_kv_blocks=200), requests)
    tight = _engine(tiny_llama_dir, num_kv_blocks=7, swap_space=SWAP_BYTES, preemption_mode="swap")
    assert _samples(tight, requests) == want
    stats = tight.scheduler.stats()
    assert stats.num_preemptions_swap > 0 and stats.num_swapped_out_blocks > 0 and stats.num_preemptions_recompute == 0
    assert _all_blocks_free(tight)


def test_samples_sharing_blocks_under_swap_pressure(tiny_llama_dir):
    """3 greedy samples of each of two prompts: shared prompt blocks, copies of the shared
    partial block, swaps (auto mode swaps requests with several samples)."""
    requests = {rid: (PROMPTS[rid], _greedy(), 3) for rid in ("r1", "r3")}
    want = _samples(_engine(tiny_llama_dir, num_kv_blocks=200), {rid: (p, s, 1) for rid, (p, s, _) in requests.items()})
    tight = _engine(tiny_llama_dir, num_kv_blocks=9, swap_space=SWAP_BYTES)
    got = _samples(tight, requests)
    assert got == {(rid, i): want[(rid, 0)] for rid in requests for i in range(3)}
    stats = tight.scheduler.stats()
    assert stats.num_preemptions_swap > 0 and stats.num_cow_copies > 0
    assert _all_blocks_free(tight)


def test_seeded_top_k_top_p_samples_replay_alone(tiny_llama_dir):
    prompt, n, seed = PROMPTS["r1"] + [7, 8], 4, 11  # 37 tokens: the partial third block is shared
    sampling = SamplingParams(max_tokens=GEN, temperature=0.8, top_k=20, top_p=0.9, seed=seed, ignore_eos=True)
    # Another request's greedy rows in the same steps: a seeded row must not depend on them.
    tight = _engine(tiny_llama_dir, num_kv_blocks=14, enable_prefix_caching=False)
    got = _samples(tight, {"g": (prompt, sampling, n), "o": (PROMPTS["r3"], _greedy(), 2)})
    assert len({tuple(got[("g", i)]) for i in range(n)}) == n  # the samples differ
    assert tight.scheduler.stats().num_cow_copies > 0
    for i in range(n):
        alone = _engine(tiny_llama_dir, num_kv_blocks=60)
        assert _samples(alone, {"x": (prompt, replace(sampling, seed=seed + i), 1)})[("x", 0)] == got[("g", i)], i
