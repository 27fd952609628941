"""reshape_and_cache (Triton) vs torch."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels.triton.kv_cache import reshape_and_cache, reshape_and_cache_reference
from tests.kernels.helpers import DTYPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,kvh,head_dim", [(16, 3, 64), (32, 2, 128)])
def test_reshape_and_cache_matches_reference(block_size, kvh, head_dim, dtype, device):
    g = torch.Generator().manual_seed(block_size)
    T, nb = 13, 6
    cache = torch.full((2, nb, block_size, kvh, head_dim), float("nan"), dtype=dtype)
    # k, v as views into a fused qkv row (non-contiguous token stride), like the model's split
    qkv = torch.randn(T, 4 + 2 * kvh, head_dim, generator=g).to(dtype)
    k, v = qkv[:, 4 : 4 + kvh], qkv[:, 4 + kvh :]
    slots = torch.randperm(nb * block_size, generator=g)[:T]
    slots[[2, 7]] = -1  # padding tokens: skipped
    ref = cache.clone()
    reshape_and_cache_reference(k, v, ref, slots)
    out = cache.clone().to(device)
    reshape_and_cache(k.to(device), v.to(device), out, slots.to(device))
    assert torch.equal(out.cpu().nan_to_num(7.0), ref.nan_to_num(7.0))  # NaN rows = untouched, in both
    assert out.cpu().isnan().sum() == cache.isnan().sum() - 2 * (T - 2) * kvh * head_dim


def test_reshape_and_cache_rejects_bad_arguments():
    cache = torch.zeros(2, 4, 16, 2, 64)
    k = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="v shape"):
        reshape_and_cache(k, torch.zeros(3, 1, 64), cache, torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping dtype"):
        reshape_and_cache(k, k, cache, torch.arange(3.0))
    with pytest.raises(ValueError, match="dtype mismatch"):
        reshape_and_cache(k.half(), k.half(), cache, torch.arange(3))
