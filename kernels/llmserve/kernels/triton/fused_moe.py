"""Mixture-of-experts GEMMs (Triton): the routed tokens of every expert in one launch per
projection, and a plain torch reference beside them.

A token routed to top_k experts makes top_k (token, expert) pairs; pair p is token
p // top_k, slot p % top_k. The pairs are sorted by expert and each expert's run padded
to a multiple of BLOCK_M, so every BLOCK_M rows of the sorted list belong to one expert
(`align_pairs`):

    expert of each pair:  p0:e0 p1:e1 p2:e3 p3:e0 p4:e1 p5:e3 p6:e1
    BLOCK_M = 2:          [p0 p3] [p1 p4] [p6 --] [p2 p5] [-- --] ...   -- = padding (masked)
    block_expert:         [  0  ] [  1  ] [  1  ] [  3  ] [ -1  ]  ...  -1: past the end

One launch of `_grouped_gemm_kernel` computes, for each block of rows and each BLOCK_N
output columns, rows @ W[block_expert].T. The layer makes two: gate_up (row = the pair's
token: A_DIV = top_k) and down (row = the pair, times the pair's routing weight); the
top_k rows of a token are then summed. The grid is sized for the worst case (every
expert padded), so nothing waits on the device for the real block count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmserve.kernels.triton._checks import FLOAT_DTYPES, INDEX_DTYPES, check_shape, check_tensor


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
    N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm,
    A_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block past the last expert's padded run
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    valid = pair < num_pairs  # padding rows hold num_pairs
    a_row = pair // A_DIV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_row[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] -> (sorted_pairs [max_rows] int32, block_expert [max_rows / block_m]
    int32): pair ids grouped by expert, each expert's run padded to block_m with T * top_k
    (a row the kernel masks); block_expert -1 past the last run. All on the device: no sync."""
    flat = topk_ids.flatten().long()  # [P]
    P, dev = flat.numel(), flat.device
    # [E] pairs per expert (a scatter, not bincount: its output size would need the max id on the host)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    run_end = padded.cumsum(0)  # [E] end of each expert's padded run
    order = flat.argsort(stable=True)  # [P] pair ids by expert
    by_expert = flat[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[by_expert]  # place within the expert's run
    max_rows = (P + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((max_rows,), P, dtype=torch.int32, device=dev)
    sorted_pairs[(run_end - padded)[by_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, max_rows, block_m, device=dev)
    block_expert = torch.searchsorted(run_end, block_start, right=True)  # the run each block starts in
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def _grouped_gemm(a, w, out, sorted_pairs, block_expert, a_div, weights, block_m, block_n, block_k) -> None:
    # a: [rows, K]; w: [E, N, K]; out: [P, N], written at each valid pair's row.
    N, K = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_expert, weights if weights is not None else out,
        N, K, out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_DIV=a_div, MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        # NOTE: float32 products in full precision: tl.dot's default on Ampere and later is
        # TF32 (10-bit mantissas), which flipped greedy tokens against HF float32 on an H100.
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    d = h.shape[-1] // 2
    return F.silu(h[:, :d]) * h[:, d:]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor] = _silu_and_mul,
              block_m: int = 16, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows | up rows); w2: [E, H, I]; topk_weights: [T, k]
    (float32 or x's dtype); topk_ids: [T, k] -> sum_j topk_weights[:, j] * expert_j(x): [T, H]
    in x's dtype. The weighted rows are kept in float32 and summed there, rounded once."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    T, H = x.shape
    check_tensor("w13", w13, ndim=3, dtypes=(x.dtype,), device=x.device, contiguous=True)
    E, two_i = w13.shape[0], w13.shape[1]
    check_shape("w13", w13, (E, two_i, H))
    check_tensor("w2", w2, ndim=3, dtypes=(x.dtype,), device=x.device, contiguous=True)
    check_shape("w2", w2, (E, H, two_i // 2))
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, device=x.device)
    top_k = topk_ids.shape[1]
    check_shape("topk_ids", topk_ids, (T, top_k))
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    check_shape("topk_weights", topk_weights, (T, top_k))
    if T == 0:
        return torch.zeros_like(x)
    sorted_pairs, block_expert = align_pairs(topk_ids, E, block_m)
    h = torch.empty(T * top_k, two_i, dtype=x.dtype, device=x.device)  # [P, 2I]
    _grouped_gemm(x, w13, h, sorted_pairs, block_expert, top_k, None, block_m, block_n, block_k)
    g = activation(h).contiguous()  # [P, I]
    o = torch.empty(T * top_k, H, dtype=torch.float32, device=x.device)  # [P, H], weighted
    _grouped_gemm(g, w2, o, sorted_pairs, block_expert, 1, topk_weights, block_m, block_n, block_k)
    return o.view(T, top_k, H).sum(1).to(x.dtype)


def fused_moe_reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Plain torch: each expert's gated MLP over the tokens routed to it, one expert at a time."""
    T, top_k = topk_ids.shape
    out = torch.zeros(T, top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel():
            y = F.linear(_silu_and_mul(F.linear(x[tok], w13[e])), w2[e])  # [n, H]
            out[tok, slot] = y.float() * topk_weights[tok, slot, None].float()
    return out.sum(1).to(x.dtype)
