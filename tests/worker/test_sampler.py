from __future__ import annotations

import torch

from llmserve.contract.sampling import SamplingParams as P
from llmserve.worker.sampler import Sampler, SamplingRows


def _sample(sampler: Sampler, logits, params, output_indices) -> tuple[list[int], list]:
    out = sampler(logits, SamplingRows.from_params(params, output_indices))
    assert out.token_ids.dtype == torch.long and out.token_ids.device == logits.device
    return out.token_ids.tolist(), out.logprobs


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_and_tiny_top_p_are_argmax():
    lg = _logits()
    expect = lg.argmax(-1).tolist()
    s = Sampler(seed=0)
    assert _sample(s, lg, [P(temperature=0.0)] * 4, [0] * 4)[0] == expect
    assert _sample(s, lg, [P(temperature=1.5, top_k=1)] * 4, [0] * 4)[0] == expect
    assert _sample(s, lg, [P(temperature=1.5, top_p=1e-6)] * 4, [0] * 4)[0] == expect


def test_top_k_restricts_support():
    lg = _logits(rows=1, vocab=50).repeat(300, 1)
    allowed = set(lg[0].topk(3).indices.tolist())
    toks, _ = _sample(Sampler(seed=1), lg, [P(temperature=5.0, top_k=3)] * 300, [0] * 300)
    assert set(toks) == allowed  # hot temperature: all 3 show up, nothing else


def test_seeded_row_independent_of_batch_and_depends_on_output_index():
    lg = _logits(rows=6)
    seeded = P(temperature=1.0, seed=42)
    a, _ = _sample(Sampler(seed=0), lg[[0]], [seeded], [7])
    b, _ = _sample(Sampler(seed=9), lg[[3, 1, 0, 2]], [P(), P(temperature=0.0), seeded, P(seed=5)], [0, 0, 7, 0])
    assert a[0] == b[2]
    draws = {_sample(Sampler(), lg[[0]] * 0.01, [seeded], [i])[0][0] for i in range(40)}
    assert len(draws) > 5  # a different draw per output index (near-uniform distribution)


def test_logprobs_from_raw_logits():
    lg = _logits(rows=3)
    params = [P(temperature=0.7, top_k=5, logprobs=4), P(temperature=0.0), P(temperature=0.0, logprobs=0)]
    toks, lps = _sample(Sampler(seed=0), lg, params, [0, 0, 0])
    ref = torch.log_softmax(lg.float(), dim=-1)
    assert lps[1] is None
    lp0 = lps[0]
    assert lp0.token_id == toks[0] and abs(lp0.logprob - ref[0, toks[0]].item()) < 1e-5
    assert list(lp0.top_logprobs) == sorted(lp0.top_logprobs, reverse=True)
    assert list(lp0.top_token_ids) == ref[0].topk(4).indices.tolist()
    torch.testing.assert_close(torch.tensor(lp0.top_logprobs), ref[0].topk(4).values)
    assert lps[2].top_token_ids == () and abs(lps[2].logprob - ref[2].max().item()) < 1e-5


def test_temperature_sampling_frequencies():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n, temp = 4000, 2.0
    # logits such that softmax(logits / temp) == probs
    lg = (probs.log() * temp).repeat(n, 1)
    toks, _ = _sample(Sampler(seed=123), lg, [P(temperature=temp)] * n, [0] * n)
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.03, freq


def test_seeded_rows_follow_distribution():
    probs = torch.tensor([0.25, 0.5, 0.25])
    n = 2000
    lg = probs.log().repeat(n, 1)
    toks, _ = _sample(Sampler(), lg, [P(seed=s) for s in range(n)], [0] * n)
    freq = torch.bincount(torch.tensor(toks), minlength=3).float() / n
    assert (freq - probs).abs().max() < 0.04, freq
