"""RMSNorm, optionally fused with the residual add (Triton), and its torch reference.

  fused:  s = x + residual;  residual <- s;  out = weight * norm(s)
  plain:  out = weight * norm(x)
norm() in fp32, rounded to x's dtype before the weight (as the model's RMSNorm).
One program per row; the whole row is one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.triton._checks import FLOAT_DTYPES, check_shape, check_tensor, next_pow2


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, res_ptr, w_ptr, stride_o, stride_x, stride_r, N, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < N
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like torch's add
        tl.store(res_ptr + row * stride_r + c, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, N]; weight: [N]; residual: [T, N] or None (updated in place to x + residual).
    Returns a new [T, N] tensor of dtype promote(x, weight)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    T, N = x.shape
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("weight", weight, (N,))
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        check_shape("residual", residual, (T, N))
    out = torch.empty(T, N, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if T == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(T,)](
        out, x, res, weight, out.stride(0), x.stride(0), res.stride(0), N, float(eps),
        BLOCK=next_pow2(N), HAS_RESIDUAL=residual is not None, num_warps=4 if N <= 4096 else 8,
    )
    return out


def rms_norm_reference(x, weight, eps, residual=None) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)  # the add in x's dtype, as torch would
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
