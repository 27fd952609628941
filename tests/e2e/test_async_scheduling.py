"""The pipelined engine loop (--async-scheduling) against the serial one on real
clusters: the same requests give the same tokens, greedy ones equal HF's, and sampled
ones with a fixed seed are identical too."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import start_cluster
from .reference import hf_greedy
from .stats import wait_all_blocks_free
from .test_hf_equivalence import MAX_NEW_TOKENS, RAW_PROMPTS, assert_same_greedy, prompt_ids
from .test_scheduling import RAW_PROMPTS as MORE_PROMPTS


async def one(client, prompt: str, **kwargs) -> dict[int, list[int]]:
    """Each sample's token ids."""
    ids: dict[int, list[int]] = {}
    async for delta in client.generate(prompt, **kwargs):
        ids.setdefault(delta.index, []).extend(delta.token_ids)
    return ids


async def workload(cluster) -> list[dict[int, list[int]]]:
    """Greedy prompts sharing steps, seeded sampled ones (n = 2 among them), and
    requests that may stop early at eos, all at once."""
    greedy = dict(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    async with cluster.client() as client:
        calls = [one(client, p, **greedy) for p in RAW_PROMPTS]
        calls += [one(client, p, max_tokens=24, temperature=1.0, seed=1234 + i, n=1 + i % 2)
                  for i, p in enumerate(MORE_PROMPTS[:4])]
        calls += [one(client, p, max_tokens=48, temperature=0.0) for p in MORE_PROMPTS[4:]]
        return await asyncio.gather(*calls)


@pytest.mark.slow
async def test_pipelined_and_serial_loops_give_the_same_tokens(model_dir, tmp_path):
    outputs = {}
    for flag in ("--no-async-scheduling", "--async-scheduling"):
        cluster = start_cluster(model_dir, tmp_path / flag.strip("-"), scheduler_args=[flag],
                                worker_args=["--kv-cache-memory", "512MiB"])
        try:
            outputs[flag] = await workload(cluster)
            stats = await wait_all_blocks_free(cluster)
        finally:
            cluster.stop()
        assert stats.num_free_blocks == stats.num_total_blocks
    serial, pipelined = outputs["--no-async-scheduling"], outputs["--async-scheduling"]
    assert pipelined == serial
    assert [len(o) for o in serial[len(RAW_PROMPTS):len(RAW_PROMPTS) + 4]] == [1, 2, 1, 2]
    for prompt, ours in zip(RAW_PROMPTS, pipelined):
        ref, ref_logprobs = hf_greedy(str(model_dir), prompt_ids(model_dir, prompt, False), MAX_NEW_TOKENS)
        assert_same_greedy(ours[0], ref, ref_logprobs, f"raw {prompt!r}")
