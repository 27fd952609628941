"""Rotary position embedding applied in place to q and k (Triton), with a torch reference.

Pairs (x1, x2) of each head are rotated by angle position * inv_freq[i], i < D/2:
  neox (rotate-half, Llama here):  x1 = x[i],      x2 = x[i + D/2]
  GPT-J (interleaved):             x1 = x[2i],     x2 = x[2i + 1]
  x1' = x1*cos - x2*sin;  x2' = x2*cos + x1*sin       (fp32 math, stored in x's dtype)
One program per token: cos/sin loaded once, then all q heads and all k heads as tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.triton._checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor, next_pow2


@triton.jit
def _rotate_heads(base, stride_h, n_heads, H_PAD: tl.constexpr, off1, off2, i_mask, cos, sin):
    h = tl.arange(0, H_PAD)
    mask = (h < n_heads)[:, None] & i_mask[None, :]
    p1 = base + h[:, None] * stride_h + off1[None, :]
    p2 = base + h[:, None] * stride_h + off2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(base.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos[None, :] + x1 * sin[None, :]).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    i_mask = i < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i_mask, other=0.0).to(tl.float32)
    if IS_NEOX:
        off1 = i
        off2 = i + HALF
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_q_heads, QH_PAD, off1, off2, i_mask, cos, sin)
    _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_k_heads, KH_PAD, off1, off2, i_mask, cos, sin)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """In place. positions: [T]; q: [T, H, D]; k: [T, KVH, D] (views into a fused qkv
    output are fine: only the last dim must be contiguous); cos, sin: [max_pos, D/2]."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev = q.device
    T, H, D = q.shape
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=dev)
    check_shape("k", k, (T, None, D))
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_shape("positions", positions, (T,))
    if D % 2:
        raise ValueError(f"head_dim {D} must be even")
    for name, c in (("cos", cos), ("sin", sin)):
        check_tensor(name, c, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
        check_shape(name, c, (None, D // 2))
    if T == 0:
        return
    _rotary_kernel[(T,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), H, k.shape[1],
        HALF=D // 2, HALF_PAD=next_pow2(D // 2), QH_PAD=next_pow2(H), KH_PAD=next_pow2(k.shape[1]),
        IS_NEOX=is_neox, num_warps=4,
    )


def rotary_embedding_reference(positions, q, k, cos, sin, is_neox: bool = True) -> None:
    c = cos[positions].float()[:, None, :]  # [T, 1, D/2]
    s = sin[positions].float()[:, None, :]
    for x in (q, k):
        xf = x.float()
        if is_neox:
            x1, x2 = xf.chunk(2, dim=-1)
            x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        else:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            x.copy_(torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2))
