"""Top-k / top-p filtering for a batch with per-row parameters (Triton), torch reference.

Semantics (the worker sampler's): top-k keeps logits >= the k-th largest (k <= 0 or
k >= V: off); then top-p, on the softmax of what top-k kept, keeps a token while the mass
of the tokens ranked above it is < p (the top token always stays; p >= 1: off), and
keeps every token tied with the last one kept (the cut never depends on how equal logits
were ordered). Dropped logits become -inf. Parameters are tensors, so no host sync per row.

Kernel: sort-free. Each program owns a row and finds both thresholds by bisection over
the order-preserving int32 image of the fp32 logits (<= 32 steps each, exact):
  top-k:  largest key t with count(key >= t) >= k
  top-p:  smallest key t with mass(key > t) < p * Z      (Z = mass kept by top-k)
Each bisection step is one pass over the row in BLOCK_V tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.triton._checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor


@triton.jit
def _key(x):
    """fp32 -> int32 with the same order (IEEE bits, negatives flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _count_ge(row_ptr, V, t, BLOCK_V: tl.constexpr):
    n = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK_V):
        o = start + tl.arange(0, BLOCK_V)
        m = o < V
        x = tl.load(row_ptr + o, mask=m, other=float("-inf")).to(tl.float32)
        n += tl.sum(tl.where(m & (_key(x) >= t), 1, 0), axis=0)
    return n


@triton.jit
def _mass_gt(row_ptr, V, t, t_k, x_max, BLOCK_V: tl.constexpr):
    """Unnormalised softmax mass of the tokens with key > t among those top-k kept."""
    z = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        o = start + tl.arange(0, BLOCK_V)
        m = o < V
        x = tl.load(row_ptr + o, mask=m, other=float("-inf")).to(tl.float32)
        key = _key(x)
        z += tl.sum(tl.where(m & (key > t) & (key >= t_k), tl.exp(x - x_max), 0.0), axis=0)
    return z


@triton.jit
def _top_k_top_p_kernel(out_ptr, logits_ptr, k_ptr, p_ptr, V, stride_l, stride_o, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * stride_l
    k = tl.load(k_ptr + row).to(tl.int32)
    k = tl.where((k <= 0) | (k > V), V, k)
    top_p = tl.load(p_ptr + row).to(tl.float32)

    # pass 0: key range and max value
    k_min = tl.full([], 2147483647, tl.int32)
    k_max = tl.full([], -2147483647 - 1, tl.int32)
    x_max = tl.full([], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        o = start + tl.arange(0, BLOCK_V)
        m = o < V
        x = tl.load(src + o, mask=m, other=float("-inf")).to(tl.float32)
        key = _key(x)
        k_min = tl.minimum(k_min, tl.min(tl.where(m, key, 2147483647), axis=0))
        k_max = tl.maximum(k_max, tl.max(tl.where(m, key, -2147483647 - 1), axis=0))
        x_max = tl.maximum(x_max, tl.max(x, axis=0))

    # top-k: invariant count(>= lo) >= k > count(>= hi)
    lo = k_min.to(tl.int64)
    hi = k_max.to(tl.int64) + 1
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        ok = _count_ge(src, V, mid, BLOCK_V) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    t_k = lo

    # top-p: invariant mass(> lo) >= p*Z > mass(> hi)
    z = _mass_gt(src, V, t_k - 1, t_k, x_max, BLOCK_V)
    lo = t_k - 1
    hi = k_max.to(tl.int64)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        ok = _mass_gt(src, V, mid, t_k, x_max, BLOCK_V) < top_p * z
        lo = tl.where(ok, lo, mid)
        hi = tl.where(ok, mid, hi)
    t = tl.where(top_p < 1.0, tl.maximum(hi, t_k), t_k)

    for start in range(0, V, BLOCK_V):
        o = start + tl.arange(0, BLOCK_V)
        m = o < V
        x = tl.load(src + o, mask=m, other=0.0)
        keep = _key(x.to(tl.float32)) >= t
        tl.store(out_ptr + row * stride_o + o, tl.where(keep, x, float("-inf")), mask=m)


def _check(logits, top_k, top_p) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    R = logits.shape[0]
    check_tensor("top_k", top_k, ndim=1, dtypes=INDEX_DTYPES, device=logits.device)
    check_tensor("top_p", top_p, ndim=1, dtypes=FLOAT_DTYPES, device=logits.device)
    check_shape("top_k", top_k, (R,))
    check_shape("top_p", top_p, (R,))


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] (temperature already applied); top_k: [R] int; top_p: [R] float.
    Returns a new [R, V] tensor with the dropped logits set to -inf."""
    _check(logits, top_k, top_p)
    R, V = logits.shape
    out = torch.empty_like(logits)
    if R and V:
        _top_k_top_p_kernel[(R,)](
            out, logits, top_k, top_p, V, logits.stride(0), out.stride(0),
            BLOCK_V=min(4096, triton.next_power_of_2(V)), num_warps=8,
        )
    return out


def top_k_top_p_filter_reference(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sort based, batched (no per-row host sync either); the CPU path."""
    _check(logits, top_k, top_p)
    R, V = logits.shape
    x = logits.float()
    k = torch.where((top_k <= 0) | (top_k > V), V, top_k).long()
    sorted_x = x.sort(dim=-1, descending=True).values
    x = x.masked_fill(x < sorted_x.gather(1, k[:, None] - 1), float("-inf"))
    sorted_x = x.sort(dim=-1, descending=True).values
    probs = sorted_x.softmax(dim=-1)
    p = top_p.float()[:, None]
    drop_sorted = (probs.cumsum(dim=-1) - probs >= p) & (p < 1.0)
    drop_sorted[:, 0] = False
    # Tokens tied with the last one kept stay too (the kernel thresholds by value).
    last_kept = sorted_x.masked_fill(drop_sorted, float("inf")).min(dim=-1, keepdim=True).values
    return x.masked_fill(x < last_kept, float("-inf")).to(logits.dtype)
