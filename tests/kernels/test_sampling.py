"""Batched top-k / top-p filtering: kernel vs torch reference vs the worker sampler."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels.triton.sampling import top_k_top_p_filter, top_k_top_p_filter_reference
from llmserve.contract.sampling import SamplingParams
from llmserve.worker.sampler import SamplingRows, _filtered_probs
from tests.kernels.helpers import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(dtype, device):
    g = torch.Generator().manual_seed(0)
    V = 300
    logits = (3 * torch.randn(6, V, generator=g)).to(dtype)
    logits[5, :100] = float("-inf")  # already-masked entries
    top_k = torch.tensor([0, 5, 50, 1, 400, 20])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3, 1.0, 0.8])
    ref = top_k_top_p_filter_reference(logits, top_k, top_p)
    out = top_k_top_p_filter(logits.to(device), top_k.to(device), top_p.to(device)).cpu()
    assert torch.equal(out, ref)
    kept = (~ref.isinf()).sum(1).tolist()
    assert kept[1] == 5 and kept[3] == 1 and kept[4] == V and 1 <= kept[5] <= 20


def test_reference_matches_sampler_semantics():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 200, generator=g)
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in [(0, 0.7), (10, 1.0), (30, 0.4), (0, 1.0)]]
    want = _filtered_probs(logits, SamplingRows.from_params(params, [0] * 4))
    got = top_k_top_p_filter_reference(logits, torch.tensor([p.top_k for p in params]),
                                       torch.tensor([p.top_p for p in params])).softmax(-1)
    assert torch.allclose(got, want, atol=1e-7)


def test_tied_logits_at_the_top_p_cut_all_stay_in_kernel_reference_and_sampler(device):
    # Softmax of [2, 1, 1, 0] ~ [0.48, 0.18, 0.18, 0.06]: p = 0.6 keeps the 2 and a first 1;
    # its twin ties it and stays too, whichever the sort put first.
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0], [0.0, 1.0, 2.0, 1.0]])
    top_k, top_p = torch.tensor([0, 0]), torch.tensor([0.6, 0.6])
    ref = top_k_top_p_filter_reference(logits, top_k, top_p)
    out = top_k_top_p_filter(logits.to(device), top_k.to(device), top_p.to(device)).cpu()
    probs = _filtered_probs(logits, SamplingRows.from_params([SamplingParams(temperature=1.0, top_p=0.6)] * 2, [0, 0]))
    assert (~ref.isinf()).tolist() == (~out.isinf()).tolist() == (probs > 0).tolist() == \
        [[True, True, True, False], [False, True, True, True]]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k shape"):
        top_k_top_p_filter(torch.zeros(2, 8), torch.zeros(3, dtype=torch.long), torch.ones(2))
    with pytest.raises(ValueError, match="top_p dtype"):
        top_k_top_p_filter(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long))
