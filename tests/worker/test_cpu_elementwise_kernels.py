"""The fused C++ CPU element-wise ops against the plain torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.activation import SiluAndMul
from llmserve.worker.layers.norm import RMSNorm
from llmserve.worker.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_qkv

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")

# Row counts: a decode batch (one thread) and a prefill chunk (split across threads).
ROWS = [1, 7, 300]
DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        # Same op-by-op rounding as torch: identical except where float32 summation order
        # or exp() moves an intermediate across a bfloat16 rounding boundary (one ulp
        # there, at most two in the result).
        ulp = want.float().abs().clamp(min=1e-30) * 2**-6
        return bool(((got.float() - want.float()).abs() <= ulp).all()) and \
            (got != want).float().mean().item() < 0.01
    return torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm_and_fused_residual_add_match_torch(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)

    assert close(cpu_kernels.rms_norm(x, norm.weight, norm.eps), norm.forward_native(x), dtype)
    want_out, want_sum = norm.forward_native(x, residual)
    got_out, got_sum = cpu_kernels.fused_add_rms_norm(x.clone(), residual.clone(), norm.weight, norm.eps)
    assert close(got_sum, want_sum, dtype)
    assert close(got_out, want_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_torch(dtype, rows):
    x = (4 * torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows))).to(dtype)
    got = cpu_kernels.silu_and_mul(x)
    assert got.shape == (rows, 1536)
    assert close(got, SiluAndMul.forward_native(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128)])
def test_rotary_on_fused_qkv_matches_torch(dtype, rows, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(rows * heads)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 100000.0}, dtype=dtype)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    cos_sin = rope(positions)

    if dtype == torch.float32:  # through the layer's entry point
        q, k, v = apply_rotary_qkv(qkv.clone(), cos_sin, heads, kv_heads, head_dim)
    else:
        rotated = qkv.clone()
        cpu_kernels.rotary_neox_(rotated, cos_sin[0].reshape(rows, -1), cos_sin[1].reshape(rows, -1),
                                 heads + kv_heads, head_dim)
        q, k, v = rotated.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = q.reshape(rows, heads, head_dim), k.reshape(rows, kv_heads, head_dim), v.reshape(rows, kv_heads, head_dim)
    want_q, want_k, want_v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert close(q, apply_rotary(want_q.reshape(rows, heads, head_dim), cos_sin), dtype)
    assert close(k, apply_rotary(want_k.reshape(rows, kv_heads, head_dim), cos_sin), dtype)
    assert torch.equal(v, want_v.reshape(rows, kv_heads, head_dim))  # v is never rotated


def test_kernels_reject_bad_shapes_with_clear_errors():
    with pytest.raises(RuntimeError, match="rms_norm"):
        cpu_kernels.rms_norm(torch.randn(4, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        cpu_kernels.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="rotary"):
        cpu_kernels.rotary_neox_(torch.randn(4, 64), torch.ones(4, 32), torch.ones(4, 32), 2, 64)


def test_layers_take_the_fused_path_for_float32_and_bfloat16():
    x = torch.randn(3, 64)
    assert cpu_kernels.usable_for(x) and cpu_kernels.usable_for(x.to(torch.bfloat16))
    assert not cpu_kernels.usable_for(x.to(torch.float16))
