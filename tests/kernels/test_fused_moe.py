"""The fused-MoE grouped GEMMs (Triton) vs the per-expert torch reference, and the
expert-sorted, block-padded pair layout they read."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels.triton.fused_moe import align_pairs, fused_moe, fused_moe_reference
from tests.kernels.helpers import DTYPES, TOL, rel_err


def _case(T, E, H, I, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    logits = torch.randn(T, E, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, w13, w2, weights, ids


def test_align_pairs_groups_by_expert_in_padded_blocks():
    ids = torch.tensor([[0, 1], [3, 0], [1, 3], [1, 0]])  # pairs p0..p7 -> experts 0 1 3 0 1 3 1 0
    pairs, block_expert = align_pairs(ids, num_experts=4, block_m=2)
    P = 8  # the padding value
    # expert 0: p0 p3 p7 | expert 1: p1 p4 p6 | expert 2: none | expert 3: p2 p5, each run padded to 2
    assert pairs.tolist()[:10] == [0, 3, 7, P, 1, 4, 6, P, 2, 5] and set(pairs.tolist()[10:]) == {P}
    assert block_expert.tolist()[:5] == [0, 0, 1, 1, 3] and set(block_expert.tolist()[5:]) == {-1}
    assert pairs.numel() == block_expert.numel() * 2 >= P + 4 * (2 - 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,top_k", [(1, 4, 2), (7, 8, 2), (33, 4, 3)])
def test_fused_moe_matches_reference(T, E, top_k, dtype, device):
    x, w13, w2, weights, ids = _case(T, E, 48, 40, top_k, dtype, seed=T)  # H, I not multiples of the blocks
    ref = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_moe(x.to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device),
                    block_m=16, block_n=32, block_k=32)
    assert out.dtype == dtype
    assert rel_err(out.cpu(), ref) <= TOL[dtype]


def test_fused_moe_rejects_bad_arguments():
    x, w13, w2, weights, ids = _case(3, 4, 32, 16, 2, torch.float32)
    with pytest.raises(ValueError, match="w2 shape"):
        fused_moe(x, w13, w2[:, :, :8].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="topk_ids dtype"):
        fused_moe(x, w13, w2, weights, ids.float())
