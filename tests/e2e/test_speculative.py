"""A cluster with speculative decoding (--speculative-tokens) against the default one:
the same results for greedy, seeded, multi-sample and stop-string requests; drafts
accepted on a request that copies its prompt, counted in the stats and the metrics."""

from __future__ import annotations

import asyncio

import pytest

from llmserve.launcher.cluster import free_port

from .conftest import start_cluster
from .stats import scheduler_stats, scrape, wait_all_blocks_free

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
           "All that glitters is not gold. Actions speak louder than words.")
COPY = [{"role": "user", "content": "Repeat the following text exactly, word for word:\n\n" + PASSAGE}]


@pytest.fixture(scope="module")
def speculative_cluster(model_dir, tmp_path_factory):
    metrics_port = free_port()
    c = start_cluster(model_dir, tmp_path_factory.mktemp("speculative-logs"),
                      scheduler_args=["--speculative-tokens", "4", "--metrics-port", str(metrics_port)],
                      worker_args=["--kv-cache-memory", "128MiB"])
    c.metrics_port = metrics_port
    yield c
    c.stop()


async def _collect(client, **kwargs):
    """Per sample index: text, token ids, rounded logprobs; finishes."""
    per_index, finishes = {}, {}
    async for d in client.generate(**kwargs):
        text, ids, lps = per_index.get(d.index, ("", [], []))
        per_index[d.index] = (text + d.text, ids + list(d.token_ids), lps + [round(lp.logprob, 3) for lp in d.logprobs])
        finishes[d.index] = d.finish_reason or finishes.get(d.index)
    return per_index, finishes


@pytest.mark.slow
async def test_speculation_changes_no_result_and_copies_run_ahead(cluster, speculative_cluster):
    async with cluster.client() as plain, speculative_cluster.client() as spec:
        copy = dict(messages=COPY, max_tokens=60, temperature=0.0)
        got = await _collect(spec, **copy)
        assert got == await _collect(plain, **copy)
        assert "journey of a thousand miles" in got[0][0][0]
        stats = await scheduler_stats(speculative_cluster)
        assert stats.spec_num_accepted_tokens >= 20, stats
        assert stats.num_steps < len(got[0][0][1]) - 10  # several tokens per step
        sizes = [len(d.token_ids) async for d in spec.generate(**copy)]
        assert max(sizes) > 1  # accepted drafts reach the client together
        cases = [
            dict(prompt="Once upon a time", max_tokens=24, temperature=0.8, seed=5, n=2, ignore_eos=True,
                 logprobs=2),
            dict(messages=COPY, max_tokens=60, temperature=0.0, stop=["single step"]),
        ]
        for kwargs in cases:
            assert await _collect(spec, **kwargs) == await _collect(plain, **kwargs), kwargs
        # Concurrent requests (drafts in batched steps) give what each gives alone.
        prompts = ["The three primary colors are", "Photosynthesis is the process by which"]
        together = await asyncio.gather(spec.complete(messages=COPY, max_tokens=40, temperature=0.0),
                                        *(spec.complete(p, max_tokens=24, temperature=0.0, ignore_eos=True)
                                          for p in prompts))
        assert together[1:] == [await plain.complete(p, max_tokens=24, temperature=0.0, ignore_eos=True)
                                for p in prompts]
    stats = await wait_all_blocks_free(speculative_cluster)
    metrics = scrape(speculative_cluster.metrics_port)
    assert metrics["llmserve_spec_decode_num_accepted_tokens_total"] == stats.spec_num_accepted_tokens
    assert metrics["llmserve_spec_decode_num_draft_tokens_total"] == stats.spec_num_draft_tokens
    assert metrics['llmserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == \
        stats.spec_accepted_per_position[0] > 0
