"""Acceptance 6: streamed text deltas concatenate to exactly the detokenized output,
including multi-byte characters split across tokens; stop strings and logprobs."""

from __future__ import annotations

import pytest

from .conftest import start_cluster
from .reference import hf_tokenizer


async def stream(client, **kwargs):
    deltas, ids, finish, usage = [], [], None, None
    async for delta in client.generate(**kwargs):
        deltas.append(delta.text)
        ids += delta.token_ids
        finish = delta.finish_reason or finish
        usage = delta.usage or usage
    return deltas, ids, finish, usage


@pytest.mark.slow
async def test_multibyte_deltas_concatenate_to_full_decode(cluster, model_dir):
    tok = hf_tokenizer(str(model_dir))
    prompts = ["请用中文介绍一下长城。", "Reply only with emoji: 🎉🚀👩‍👩‍👧", "日本の首都は東京です。次に"]
    saw_multibyte = False
    async with cluster.client() as client:
        for i, prompt in enumerate(prompts):
            for temperature in (0.0, 1.3):
                deltas, ids, finish, usage = await stream(
                    client, messages=[{"role": "user", "content": prompt}], max_tokens=48,
                    temperature=temperature, seed=i, ignore_eos=True)
                full = tok.decode(ids, skip_special_tokens=True)
                assert "".join(deltas) == full
                assert finish == "length" and usage["completion_tokens"] == 48
                saw_multibyte |= any(ord(ch) > 0x7FF for ch in full)
                assert "\ufffd" not in "".join(deltas[:-1]) or "\ufffd" in full
    assert saw_multibyte, "no output had a multi-byte character: the test proved nothing"


@pytest.mark.slow
async def test_stop_string_is_cut_and_reported(cluster):
    async with cluster.client() as client:
        base = await client.complete("The three primary colors are", max_tokens=32, temperature=0.0,
                                     ignore_eos=True)
        words = base.split()
        stop = words[len(words) // 2]  # A word from the middle of the greedy answer.
        deltas, ids, finish, _ = await stream(client, prompt="The three primary colors are", max_tokens=32,
                                              temperature=0.0, ignore_eos=True, stop=[stop])
    text = "".join(deltas)
    assert finish == "stop"
    assert stop not in text
    assert base.startswith(text) and base[len(text):].startswith(stop)
    assert len(ids) < 32


@pytest.mark.slow
async def test_seeded_sampling_is_reproducible_and_logprobs_returned(cluster):
    async with cluster.client() as client:
        kwargs = dict(prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95, top_k=50,
                      seed=1234, ignore_eos=True, logprobs=3)
        runs = []
        for _ in range(2):
            ids, lps = [], []
            async for delta in client.generate(**kwargs):
                ids += delta.token_ids
                lps += delta.logprobs
            runs.append((ids, lps))
    (ids_a, lps_a), (ids_b, _) = runs
    assert ids_a == ids_b
    assert len(lps_a) == 16
    for token_id, lp in zip(ids_a, lps_a):
        assert lp.token_id == token_id and lp.logprob <= 0
        assert len(lp.top_token_ids) == 3
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        assert lp.logprob <= lp.top_logprobs[0] + 1e-6


@pytest.mark.slow
async def test_n_samples_stream_with_their_index(cluster):
    async with cluster.client() as client:
        per_index: dict[int, list[int]] = {}
        usage = None
        async for delta in client.generate("Tell me a story", max_tokens=8, temperature=1.0, seed=7, n=3,
                                           ignore_eos=True):
            per_index.setdefault(delta.index, []).extend(delta.token_ids)
            usage = delta.usage or usage
    assert sorted(per_index) == [0, 1, 2]
    assert all(len(v) == 8 for v in per_index.values())
    assert len({tuple(v) for v in per_index.values()}) == 3  # Seeds 7, 8, 9.
    assert usage["completion_tokens"] == 24


@pytest.mark.slow
async def test_second_request_reuses_the_cached_prefix(cluster):
    prefix = [(i * 37) % 5000 + 100 for i in range(200)]
    async with cluster.client() as client:
        _, ids_a, _, usage_a = await stream(client, token_ids=prefix + [11, 12], max_tokens=4, temperature=0.0,
                                            ignore_eos=True)
        _, ids_b, _, usage_b = await stream(client, token_ids=prefix + [13, 14, 15], max_tokens=4,
                                            temperature=0.0, ignore_eos=True)
    assert usage_a["cached_tokens"] == 0
    assert usage_b["cached_tokens"] == 192  # 12 full blocks of 16 tokens.
    assert len(ids_b) == 4


@pytest.mark.slow
async def test_stream_interval_groups_tokens_and_changes_no_result(cluster, model_dir, tmp_path):
    """--stream-interval 4: first token alone, then 4 at a time, the rest with the finish;
    tokens, text, stop strings and logprobs as with the default interval of 1."""
    grouped = start_cluster(model_dir, tmp_path, scheduler_args=["--stream-interval", "4"],
                            worker_args=["--kv-cache-memory", "128MiB"])
    try:
        async with cluster.client() as every, grouped.client() as by_four:
            sizes = [len(d.token_ids) async for d in by_four.generate(
                "The three primary colors are", max_tokens=10, temperature=0.0, ignore_eos=True)]
            assert sizes == [1, 4, 4, 1]
            base = await every.complete("The three primary colors are", max_tokens=32, temperature=0.0,
                                        ignore_eos=True)
            stop = base.split()[len(base.split()) // 2]
            cases = [dict(prompt="The three primary colors are", max_tokens=32, temperature=0.0,
                          ignore_eos=True, stop=[stop]),
                     dict(prompt="Once upon a time", max_tokens=13, temperature=0.9, seed=5, n=2,
                          ignore_eos=True, logprobs=2)]
            outcomes = []
            for kwargs in cases:
                results = []
                for client in (every, by_four):
                    per_index: dict[int, tuple[str, list[int], list[float]]] = {}
                    finishes, usage = {}, None
                    async for d in client.generate(**kwargs):
                        text, ids, lps = per_index.get(d.index, ("", [], []))
                        per_index[d.index] = (text + d.text, ids + list(d.token_ids),
                                              lps + [round(lp.logprob, 4) for lp in d.logprobs])
                        finishes[d.index] = d.finish_reason or finishes.get(d.index)
                        usage = d.usage or usage
                    results.append((per_index, finishes, usage["completion_tokens"]))
                assert results[1] == results[0], kwargs
                outcomes.append(results[0])
            assert outcomes[0][1] == {0: "stop"}
            assert outcomes[1][1] == {0: "length", 1: "length"} and outcomes[1][2] == 26
    finally:
        grouped.stop()
