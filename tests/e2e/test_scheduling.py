"""Acceptance 2-4: continuous batching, preemption under a tiny KV cache, and blocks
returned on cancellation, all observed from outside the services."""

from __future__ import annotations

import asyncio
import time

import pytest

from .conftest import start_cluster
from .stats import scheduler_stats, wait_all_blocks_free

RAW_PROMPTS = [
    "The quick brown fox",
    "In the beginning of the twentieth century, the city",
    "Photosynthesis is the process by which",
    "A good software engineer always",
    "The ocean covers most of the Earth and",
    "My favourite recipe for bread needs",
    "The first rule of distributed systems is",
    "Mountains are formed when",
]


async def stream_with_times(client, prompt: str, max_tokens: int, first_tokens: asyncio.Event | None = None,
                            min_tokens_before_signal: int = 4):
    """Returns (token ids, time of first token, time of finish)."""
    ids, first_at = [], None
    async for delta in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if delta.token_ids and first_at is None:
            first_at = time.monotonic()
        ids += delta.token_ids
        if first_tokens is not None and len(ids) >= min_tokens_before_signal:
            first_tokens.set()
    return ids, first_at, time.monotonic()


@pytest.mark.slow
async def test_new_request_joins_a_running_batch(cluster):
    async with cluster.client() as client:
        started = [asyncio.Event() for _ in range(3)]
        early = [asyncio.create_task(stream_with_times(client, p, 64, ev))
                 for p, ev in zip(RAW_PROMPTS[:3], started)]
        await asyncio.gather(*(ev.wait() for ev in started))  # All three are mid-generation.
        late_ids, late_first, _ = await stream_with_times(client, RAW_PROMPTS[3], 4)
        early_results = await asyncio.gather(*early)
    assert len(late_ids) == 4
    for ids, _, finished_at in early_results:
        assert len(ids) == 64
        # The late request did not wait for the running batch to drain.
        assert late_first < finished_at


async def run_all(cluster, max_tokens: int) -> list[list[int]]:
    async with cluster.client() as client:
        async def one(prompt):
            ids = []
            async for delta in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                ids += delta.token_ids
            return ids

        return await asyncio.gather(*(one(p) for p in RAW_PROMPTS))


@pytest.mark.slow
async def test_tiny_kv_cache_preempts_and_still_matches(cluster, model_dir, tmp_path):
    max_tokens = 40
    reference = await run_all(cluster, max_tokens)
    # Each request needs ceil((~12 prompt + 40) / 16) = 4 blocks: 8 blocks hold two at once.
    small = start_cluster(model_dir, tmp_path, worker_args=["--num-kv-blocks", "8"])
    try:
        outputs = await run_all(small, max_tokens)
        stats = await wait_all_blocks_free(small)
    finally:
        small.stop()
    assert stats.num_total_blocks == 8
    assert stats.num_preemptions > 0
    assert outputs == reference


@pytest.mark.slow
async def test_cancelled_streams_free_every_block(cluster):
    before = await scheduler_stats(cluster)
    async with cluster.client() as client:
        async def cancel_after(prompt: str, n_tokens: int) -> int:
            got = 0
            async for delta in client.generate(prompt, max_tokens=200, temperature=0.0, ignore_eos=True):
                got += len(delta.token_ids)
                if got >= n_tokens:
                    break  # Leaving the loop cancels the call.
            return got

        counts = await asyncio.gather(*(cancel_after(p, 3 + i) for i, p in enumerate(RAW_PROMPTS[:5])))
        # One more cancelled as a task, before its first token.
        task = asyncio.create_task(cancel_after(RAW_PROMPTS[5], 10_000))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert all(c >= 3 for c in counts)
    after = await wait_all_blocks_free(cluster)
    assert after.num_aborted - before.num_aborted >= 5
