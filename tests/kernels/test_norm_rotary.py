"""Fused add + RMSNorm and rotary embedding vs their torch references, and the references
vs the model's own layers."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels.triton.norm import rms_norm, rms_norm_reference
from llmserve.kernels.triton.rotary import rotary_embedding, rotary_embedding_reference
from llmserve.worker.layers.norm import RMSNorm
from llmserve.worker.layers.rotary import RotaryEmbedding, apply_rotary
from tests.kernels.helpers import DTYPES, TOL, rel_err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual, hidden, dtype, device):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    res = torch.randn(7, hidden, generator=g).to(dtype) if with_residual else None
    ref_res = res.clone() if with_residual else None
    ref = rms_norm_reference(x, w, 1e-5, ref_res)
    res_d = res.to(device) if with_residual else None
    out = rms_norm(x.to(device), w.to(device), 1e-5, res_d)
    assert rel_err(out.cpu(), ref) <= TOL[dtype]
    if with_residual:
        assert rel_err(res_d.cpu(), ref_res) <= TOL[dtype]


def test_rms_norm_reference_is_the_model_layer():
    layer = RMSNorm(96, 1e-5)
    layer.weight.data.normal_()
    x, r = torch.randn(5, 96), torch.randn(5, 96)
    out, s = layer.forward_native(x, r)  # (forward may fuse in place on CPU)
    r2 = r.clone()
    assert torch.equal(rms_norm_reference(x, layer.weight, 1e-5, r2), out) and torch.equal(r2, s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary(is_neox, head_dim, dtype, device):
    g = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 128, {"rope_theta": 10000.0}, dtype=dtype)
    T, H, KVH = 11, 6, 2
    qkv = torch.randn(T, H + 2 * KVH, head_dim, generator=g).to(dtype)  # q, k are strided views
    pos = torch.randint(0, 128, (T,), generator=g)
    ref = qkv.clone()
    rotary_embedding_reference(pos, ref[:, :H], ref[:, H : H + KVH], rope.cos, rope.sin, is_neox)
    out = qkv.clone().to(device)
    rotary_embedding(pos.to(device), out[:, :H], out[:, H : H + KVH], rope.cos.to(device), rope.sin.to(device),
                     is_neox)
    assert rel_err(out.cpu(), ref) <= TOL[dtype]
    assert torch.equal(out[:, H + KVH :].cpu(), qkv[:, H + KVH :])  # v untouched


def test_rotary_reference_is_the_model_layer():
    rope = RotaryEmbedding(64, 64, {"rope_theta": 10000.0}, dtype=torch.float32)
    pos = torch.arange(9)
    q, k = torch.randn(9, 4, 64), torch.randn(9, 2, 64)
    want_q, want_k = apply_rotary(q, rope(pos)), apply_rotary(k, rope(pos))
    rotary_embedding_reference(pos, q, k, rope.cos, rope.sin, is_neox=True)
    assert rel_err(q, want_q) < 1e-6 and rel_err(k, want_k) < 1e-6


def test_rotary_gptj_reference_pairs_adjacent_elements():
    cos, sin = torch.zeros(1, 2), torch.ones(1, 2)  # a 90 degree turn: (x1, x2) -> (-x2, x1)
    q = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    k = q.clone()
    rotary_embedding_reference(torch.tensor([0]), q, k, cos, sin, is_neox=False)
    assert q.flatten().tolist() == [-2.0, 1.0, -4.0, 3.0]


def test_rotary_rejects_bad_arguments():
    q, k = torch.zeros(3, 4, 64), torch.zeros(3, 2, 64)
    cos = torch.zeros(10, 32)
    with pytest.raises(ValueError, match="cos shape"):
        rotary_embedding(torch.arange(3), q, k, torch.zeros(10, 64), cos)
    with pytest.raises(ValueError, match="positions shape"):
        rotary_embedding(torch.arange(4), q, k, cos, cos)
    with pytest.raises(ValueError, match="k dtype"):
        rotary_embedding(torch.arange(3), q, k.half(), cos, cos)
