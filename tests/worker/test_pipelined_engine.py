"""The in-process engine's pipelined loop (InProcessEngine with async_scheduling: plan and
launch N+1, then read N back) against its serial loop, on a tiny random Llama on the CPU:
seeded random workloads (greedy and seeded sampling, n = 2, logprobs, stop tokens,
penalties, shared prefixes, chunked prefill, a KV pool small enough to
preempt) give every sample the same tokens, logprobs and finish, the pipelined loop
launches plans while another is in flight, and every block is free at the end.

On the CPU a launch runs the forward before it returns, so nothing overlaps here: what
this proves is exactness (placeholders filled from the device tensor, steps the core
cannot plan ahead run serially), which a CUDA runner relies on."""

from __future__ import annotations

import random

import pytest

from llmserve.contract.sampling import SamplingParams
from llmserve.launcher.engine import InProcessEngine

from tests.tiny_models import TINY

VOCAB = TINY["vocab_size"]


def _sampling(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "seeded", "penalized", "logprobs", "stop"])
    max_tokens = rng.randint(1, 14)
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if kind == "seeded":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, top_k=40, seed=rng.randint(0, 99),
                              ignore_eos=True)
    if kind == "penalized":  # its id in flight is penalized on the device (sampler.InFlightIds)
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                              presence_penalty=0.2, ignore_eos=True)
    if kind == "logprobs":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    # Stop tokens that a random model's greedy output does reach: many of the vocabulary.
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=tuple(range(3, VOCAB, 5)))


def _workload(seed: int) -> list[tuple[str, list[int], SamplingParams, int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 24))]
    requests = []
    for i in range(rng.randint(6, 14)):
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        prompt = prefix + own if rng.random() < 0.4 else own  # shared prefixes: prefix-cache hits
        sampling = _sampling(rng)
        n = 2 if sampling.seed is not None and rng.random() < 0.5 else 1
        requests.append((f"r{i}", prompt, sampling, n))
    return requests


def _run(model_dir, workload, pipelined: bool, **settings):
    engine = InProcessEngine.from_model_dir(model_dir, async_scheduling=pipelined, dtype="float32", **settings)
    assert engine.pipelined is pipelined
    launched_behind = []  # per launch: was another plan in flight?
    launch = engine.runner.launch

    def counting_launch(plan):
        launched_behind.append(bool(engine._in_flight))
        return launch(plan)

    engine.runner.launch = counting_launch
    for rid, prompt, sampling, n in workload:
        engine.add_request(rid, prompt, sampling, n=n)
    samples: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got = samples.setdefault((out.request_id, out.index), {"tokens": [], "logprobs": [], "finish": None})
            got["tokens"] += out.new_token_ids
            got["logprobs"] += [(lp.token_id, round(lp.logprob, 4), lp.top_token_ids) for lp in out.logprobs]
            if out.finished:
                got["finish"] = (out.finish_reason, out.error)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_total_blocks, "every block is free at the end"
    assert not engine.scheduler.audit().problems
    return samples, launched_behind, engine.scheduler.stats().num_preemptions


CASES = {
    "roomy": dict(num_kv_blocks=128, block_size=4),
    "chunked": dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=24),
    "preempting": dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("case", CASES)
def test_pipelined_engine_gives_every_sample_the_serial_loops_output(tiny_llama_dir, case):
    overlapped = preempted = 0
    for seed in range(4):
        workload = _workload(seed)
        serial, behind_serial, _ = _run(tiny_llama_dir, workload, False, **CASES[case])
        pipelined, behind, preemptions = _run(tiny_llama_dir, workload, True, **CASES[case])
        assert not any(behind_serial)
        assert pipelined == serial, (case, seed)
        assert all(s["finish"] is not None for s in serial.values())
        assert len(serial) == sum(n for *_, n in workload)
        overlapped += sum(behind)
        preempted += preemptions
    assert overlapped > 0, "the pipelined loop launched plans behind one in flight"
    if case == "preempting":
        assert preempted > 0, "the small pool preempted (those steps run serially)"


def test_the_in_process_engine_shares_cached_blocks_only_within_a_cache_salt(tiny_llama_dir):
    engine = InProcessEngine.from_model_dir(tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=4)
    prompt = list(range(3, 20))  # 17 tokens: four whole blocks to cache
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    cached = {}
    for rid, salt in (("plain", ""), ("a", "tenant-a"), ("a-again", "tenant-a"), ("b", "tenant-b")):
        engine.add_request(rid, prompt, greedy, cache_salt=salt)
        while engine.has_unfinished():
            for out in engine.step():
                cached[out.request_id] = out.num_cached_tokens
    assert cached == {"plain": 0, "a": 0, "a-again": 16, "b": 0}
