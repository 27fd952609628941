"""A cluster with multi-step scheduling (--num-scheduler-steps) against the default one:
the same results, tokens K at a time, and an arrival served without waiting for a run."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import start_cluster
from .stats import wait_all_blocks_free

PROMPTS = ["The three primary colors are", "Photosynthesis is the process by which",
           "The first rule of distributed systems is"]


@pytest.fixture(scope="module")
def multi_step_cluster(model_dir, tmp_path_factory):
    c = start_cluster(model_dir, tmp_path_factory.mktemp("multi-step-logs"),
                      scheduler_args=["--num-scheduler-steps", "4"], worker_args=["--kv-cache-memory", "128MiB"])
    yield c
    c.stop()


async def _collect(client, **kwargs):
    """Per sample index: text, token ids, rounded logprobs; finishes; completion tokens."""
    per_index, finishes, usage = {}, {}, None
    async for d in client.generate(**kwargs):
        text, ids, lps = per_index.get(d.index, ("", [], []))
        per_index[d.index] = (text + d.text, ids + list(d.token_ids), lps + [round(lp.logprob, 3) for lp in d.logprobs])
        finishes[d.index] = d.finish_reason or finishes.get(d.index)
        usage = d.usage or usage
    return per_index, finishes, usage["completion_tokens"]


@pytest.mark.slow
async def test_runs_of_four_steps_change_no_result(cluster, multi_step_cluster):
    async with cluster.client() as single, multi_step_cluster.client() as multi:
        sizes = [len(d.token_ids) async for d in multi.generate(PROMPTS[0], max_tokens=10, temperature=0.0,
                                                                 ignore_eos=True)]
        assert sizes == [1, 4, 4, 1]  # the prompt's token, two runs, one step left to max_tokens
        base = await single.complete(PROMPTS[0], max_tokens=32, temperature=0.0, ignore_eos=True)
        cases = [
            dict(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=40,
                 temperature=0.0),  # ends on eos inside a run
            dict(prompt=PROMPTS[0], max_tokens=32, temperature=0.0, ignore_eos=True,
                 stop=[base.split()[len(base.split()) // 2]]),
            dict(prompt="Once upon a time", max_tokens=13, temperature=0.9, seed=5, n=2, ignore_eos=True,
                 logprobs=2),
        ]
        for kwargs in cases:
            assert await _collect(multi, **kwargs) == await _collect(single, **kwargs), kwargs
        chat = await _collect(multi, **cases[0])
        assert chat[1] == {0: "stop"} and "Paris" in chat[0][0][0]
        # Concurrent greedy requests (batched runs) give what each gives in the default cluster.
        together = await asyncio.gather(*(multi.complete(p, max_tokens=24, temperature=0.0, ignore_eos=True)
                                          for p in PROMPTS))
        for prompt, text in zip(PROMPTS, together):
            assert text == await single.complete(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    await wait_all_blocks_free(multi_step_cluster)


@pytest.mark.slow
async def test_an_arrival_cuts_a_run_short(model_dir, tmp_path):
    """With runs of 32 steps, a request arriving while one runs is served after one more
    step, not after the other 31: the long request gets only a few tokens meanwhile."""
    c = start_cluster(model_dir, tmp_path, scheduler_args=["--num-scheduler-steps", "32"],
                      worker_args=["--kv-cache-memory", "128MiB"])
    try:
        async with c.client() as client:
            long_tokens: list[int] = []
            run_started = asyncio.Event()

            async def long_request():
                async for d in client.generate(PROMPTS[1], max_tokens=200, temperature=0.0, ignore_eos=True):
                    long_tokens.extend(d.token_ids)
                    if len(long_tokens) > 1:  # a run's tokens came back; the next run is in flight
                        run_started.set()

            task = asyncio.create_task(long_request())
            await run_started.wait()
            before = len(long_tokens)
            short = await client.complete(PROMPTS[2], max_tokens=1, temperature=0.0)
            during = len(long_tokens) - before
            await task
        assert short and len(long_tokens) == 200
        assert during <= 8, f"the long request got {during} tokens while the short one waited"
    finally:
        c.stop()
