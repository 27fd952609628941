"""Paged attention in Triton: decode (one query token per sequence, optional split-K with a
reduction kernel) and varlen prefill / mixed chunks (one launch for the whole batch).
Each kernel has a plain torch reference below it.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V).
Key position p of sequence i lives in block block_tables[i, p // block_size], row
p % block_size. Query head h reads kv head h // G, G = num_heads // num_kv_heads.

  decode program (seq, kv_head, split):            prefill program (seq, q_tile, kv_head):
    q [16+, D]: the G heads sharing one kv head,       rows r = (query r // G, head r % G)
      zero rows up to tl.dot's 16                       q [BLOCK_M, D] (Q_PER_TILE queries x G)
    for each tile of keys (64 at head dim 64,          for each tile of keys (the same size)
    fewer for wider heads) in this split's share of    up to the q tile's last position:
    the sequence: K, V [tile, D] gathered from their   K, V [tile, D] gathered, loaded once
    blocks, loaded ONCE for G heads, 2 dots, online    for BLOCK_M rows, 2 dots, causal mask,
    softmax (m, l, acc) in fp32                        online softmax in fp32

Sliding window W (0 = none): a query at position p sees keys in (p - W, p]. Decode starts
at the tile holding key len - W and masks the loads before it; prefill at the tile
holding the q tile's first query's first key, and masks the loads before that key. No
block wholly before a window is read (the scheduler may have freed it). Soft-cap c
(0 = none): scores -> c * tanh(scores / c).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.triton._checks import (
    FLOAT_DTYPES, INDEX_DTYPES, check_power_of_two, check_same_dtype, check_shape, check_tensor, next_pow2,
)

_NEG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: keeps exp(m - m_new) free of nan


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), tanh from exp (one form for the GPU and the interpreter):
    tanh(x) = 1 - 2 / (exp(2x) + 1), saturating to +-1 as exp over/underflows."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


# ----------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------
# Keys per iteration of either kernel (several blocks gathered at once; a larger block is
# one tile): 64 at head dim 64, fewer for wider heads so that a tile's K (and V) stays at
# 4096 elements, the register budget the measured decode case had (no spills at head dim
# 128, 256). NOTE: the prefill kernel iterated one 16-key block at a time (tl.dot of 16
# columns, a softmax rescale per block) until 2026-11-28; the H200's 1B offline run had
# its prompt-carrying steps at about half the matmul peak. The tile's speed there is not
# measured yet (gpu_check's offline-1b and profile steps will).
KEY_TILE = 64
_KEY_TILE_ELEMENTS = 4096


def key_tile(head_dim_pad: int, block_size: int) -> int:
    """Keys per iteration of the decode and prefill kernels: a power of two >= 16 and >=
    one block."""
    return max(16, block_size, min(KEY_TILE, _KEY_TILE_ELEMENTS // head_dim_pad))


@triton.jit
def _decode_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale, window, softcap,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, G: tl.constexpr, M_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    # This sequence's tiles from the one holding its first visible key, shared evenly by
    # the splits: the split count can stay fixed (a CUDA graph's) whatever the context
    # lengths; a split past the end is empty.
    first_tile = first_key // TILE
    n_tiles = tl.cdiv(seq_len, TILE) - first_tile
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first_tile + n_tiles)

    g = tl.arange(0, M_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, TILE)
    g_mask = g < G
    d_mask = d < D
    heads = kvh * G + g
    # q: [M_PAD, D_PAD], rows past G zero: tl.dot needs 16 rows, the GQA group has G.
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m = tl.full([M_PAD], _NEG, tl.float32)
    l = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D_PAD], tl.float32)
    for tile in range(tile_lo, tile_hi):
        # A tile gathers TILE keys from TILE / BLOCK_SIZE blocks: one load of many rows
        # in flight, not one block's round trip per iteration.
        pos = tile * TILE + t  # [TILE]
        t_mask = (pos < seq_len) & (pos >= first_key)  # no load before the window
        block_id = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        kv_off = block_id[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [TILE, D_PAD]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [TILE, D_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M_PAD, TILE] fp32
        if HAS_SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    if SPLIT:
        # partials: acc [B, H, S, D] (unnormalised), m and l [B, H, S]
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [M_PAD]
        tl.store(part_acc_ptr + row[:, None] * D + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_m_ptr + row, m, mask=g_mask)
        tl.store(part_l_ptr + row, l, mask=g_mask)
    else:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < NUM_SPLITS
    row = (seq * NUM_HEADS + h) * NUM_SPLITS + s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=_NEG)
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * D + d[None, :], mask=s_mask[:, None] & (d < D)[None, :], other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))  # empty splits: m = _NEG, l = 0 -> weight 0
    o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(out_ptr + seq * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def _check_cache_args(q, kv_cache, block_tables, seq_lens, n_rows: int, min_block: int) -> tuple[int, int, int]:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    dev = q.device
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=FLOAT_DTYPES, device=dev)
    check_same_dtype(q=q, kv_cache=kv_cache)
    _, H, D = q.shape
    two, _, bs, KVH, Dc = kv_cache.shape
    if two != 2 or Dc != D:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} is not [2, blocks, block_size, kv_heads, {D}]")
    if KVH < 1 or H % KVH:
        raise ValueError(f"num_heads {H} is not a multiple of num_kv_heads {KVH}")
    check_power_of_two("block_size", bs, min_block)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_shape("block_tables", block_tables, (n_rows, None))
    check_shape("seq_lens", seq_lens, (n_rows,))
    return H, KVH, bs


def _check_window_softcap(window: int | None, softcap: float | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")


def _check_out(out, q) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    check_tensor("out", out, dtypes=(q.dtype,), device=q.device)
    check_shape("out", out, tuple(q.shape))
    return out


def paged_attention_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, num_splits: int = 1, out: torch.Tensor | None = None, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [B, H, D] (one token per sequence, already in the cache); block_tables
    [B, max_blocks]; seq_lens [B] (>= 1, context including this token) -> out [B, H, D].
    num_splits > 1: flash-decoding, each sequence's tiles of keys (key_tile) shared evenly
    by the splits (so one split count serves any context length), partial (acc, max, sum)
    in fp32, then one reduction launch. window / softcap: see the module docstring (None = off)."""
    _check_window_softcap(window, softcap)
    B = q.shape[0] if q.dim() == 3 else -1
    H, KVH, bs = _check_cache_args(q, kv_cache, block_tables, seq_lens, B, 1)
    out = _check_out(out, q)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if B == 0:
        return out
    D = q.shape[2]
    G = H // KVH
    max_blocks = block_tables.shape[1]
    num_splits = min(num_splits, max(1, max_blocks))
    kc, vc = kv_cache[0], kv_cache[1]
    split = num_splits > 1
    if split:
        # One allocation (host time counts in eager steps): acc [B, H, S, D], m, l [B, H, S].
        part = torch.empty(B * H * num_splits * (D + 2), dtype=torch.float32, device=q.device)
        n = B * H * num_splits
        part_acc, part_m, part_l = part[: n * D], part[n * D : n * (D + 1)], part[n * (D + 1) :]
    else:
        part_acc = part_m = part_l = out  # unused
    _decode_kernel[(B, KVH, num_splits)](
        out, part_acc, part_m, part_l, q, kc, vc, block_tables, seq_lens,
        float(scale), int(window or 0), float(softcap or 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        NUM_HEADS=H, G=G, M_PAD=max(16, next_pow2(G)), D=D, D_PAD=max(16, next_pow2(D)), BLOCK_SIZE=bs,
        TILE=key_tile(max(16, next_pow2(D)), bs), NUM_SPLITS=num_splits, SPLIT=split,
        # NOTE: fp32 inputs would default to tf32 on GPU (~1e-3 error): ask for ieee.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, num_warps=4,
    )
    if split:
        _decode_reduce_kernel[(B, H)](
            out, part_acc, part_m, part_l, out.stride(0), out.stride(1),
            NUM_HEADS=H, NUM_SPLITS=num_splits, S_PAD=next_pow2(num_splits), D=D, D_PAD=next_pow2(D),
            num_warps=1,
        )
    return out


# ----------------------------------------------------------------------------------------
# Prefill / mixed chunks (varlen)
# ----------------------------------------------------------------------------------------
@triton.jit
def _varlen_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_q_ptr,
    scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, Q_PER_TILE: tl.constexpr, PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # keys cached before this chunk
    tile_q0 = tile * Q_PER_TILE

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, TILE)
    d_mask = d < D
    q_idx = tile_q0 + r // G  # query index inside the chunk
    head = kvh * G + r % G
    row_mask = (r < Q_PER_TILE * G) & (q_idx < q_len)
    q_pos = ctx + q_idx  # absolute position: sees keys 0..q_pos
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + q_idx)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, D_PAD]

    last_q = tl.minimum(tile_q0 + Q_PER_TILE, q_len) - 1
    # Keys first_key .. ctx + last_q: causal, no key past the tile's last query; with a
    # window, none before its first query's first visible key (no load before it either:
    # a block wholly before it may have been freed).
    end_key = tl.where(tile_q0 < q_len, ctx + last_q + 1, 0)
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(ctx + tile_q0 - window + 1, 0)
    m = tl.full([BLOCK_M], _NEG, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for kt in range(first_key // TILE, tl.cdiv(end_key, TILE)):
        # TILE keys gathered from their blocks at once (as the decode kernel does): dots
        # of TILE columns and one softmax rescale per TILE keys, not per block.
        pos = kt * TILE + t  # [TILE]
        t_mask = (pos < end_key) & (pos >= first_key)
        block_id = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        kv_off = block_id[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [TILE, D_PAD]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, TILE] fp32
        if HAS_SOFTCAP:
            s = _softcap(s, softcap)
        visible = (pos[None, :] <= q_pos[:, None]) & t_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + q_idx)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def varlen_key_tile(head_dim_pad: int, block_size: int, block_m: int) -> int:
    """Keys per iteration of the prefill kernel: key_tile's, fewer where the score tile
    [BLOCK_M, keys] would pass the same 4,096 elements (BLOCK_M 128, groups of 5-8 heads:
    32 keys). NOTE: a guess from the decode kernel's register budget, not measured."""
    return max(16, min(key_tile(head_dim_pad, block_size), _KEY_TILE_ELEMENTS // block_m))


def varlen_tile(num_queries_per_kv: int) -> tuple[int, int]:
    """(BLOCK_M rows, queries per tile): a tile stacks Q_PER_TILE queries x G heads."""
    G = num_queries_per_kv
    block_m = max(next_pow2(G), min(128, next_pow2(16 * G)))
    return block_m, block_m // G


def paged_attention_varlen(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, max_query_len: int, scale: float, out: torch.Tensor | None = None,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1] (absolute
    rows of q; they need not start at 0) and has seq_lens[i] keys in the cache including
    its queries, which are its last positions. One launch for all sequences; rows of `out`
    outside every sequence's range are left untouched. window / softcap: see the module
    docstring (None = off)."""
    _check_window_softcap(window, softcap)
    N = block_tables.shape[0] if block_tables.dim() == 2 else -1
    H, KVH, bs = _check_cache_args(q, kv_cache, block_tables, seq_lens, N, 16)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    check_shape("cu_seqlens_q", cu_seqlens_q, (N + 1,))
    out = _check_out(out, q)
    if N == 0 or max_query_len < 1:
        return out
    D = q.shape[2]
    G = H // KVH
    block_m, q_per_tile = varlen_tile(G)
    kc, vc = kv_cache[0], kv_cache[1]
    grid = (N, triton.cdiv(max_query_len, q_per_tile), KVH)
    _varlen_kernel[grid](
        out, q, kc, vc, block_tables, seq_lens, cu_seqlens_q, float(scale), int(window or 0), float(softcap or 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), block_tables.stride(0),
        G=G, D=D, D_PAD=max(16, next_pow2(D)), BLOCK_SIZE=bs,
        TILE=varlen_key_tile(max(16, next_pow2(D)), bs, block_m), BLOCK_M=block_m, Q_PER_TILE=q_per_tile,
        # NOTE: fp32 inputs would default to tf32 on GPU (~1e-3 error): ask for ieee.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------
# Torch references (per sequence, no tricks)
# ----------------------------------------------------------------------------------------
def gather_kv(kv_cache: torch.Tensor, table: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, contiguous: each [seq_len, KVH, D]."""
    bs = kv_cache.shape[2]
    blocks = torch.tensor(table[: triton.cdiv(seq_len, bs)], dtype=torch.long, device=kv_cache.device)
    kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len]
    return kv[0], kv[1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
    """q [n, H, D] are the last n positions of k/v [L, KVH, D]; causal (and within the
    window); fp32 math."""
    n, H, _ = q.shape
    L, KVH, _ = k.shape
    g = H // KVH
    kf = k.float().repeat_interleave(g, dim=1)  # [L, H, D]
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale  # [H, n, L]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    q_pos = torch.arange(L - n, L, device=q.device)[:, None]
    k_pos = torch.arange(L, device=q.device)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), vf).to(q.dtype)


def paged_attention_varlen_reference(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Same contract as paged_attention_varlen; rows outside every sequence are zero."""
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    for i, (table, L) in enumerate(zip(block_tables.tolist(), seq_lens.tolist())):
        if cu[i + 1] > cu[i]:
            k, v = gather_kv(kv_cache, table, L)
            out[cu[i] : cu[i + 1]] = _attend(q[cu[i] : cu[i + 1]], k, v, scale, window, softcap)
    return out


def paged_attention_decode_reference(q, kv_cache, block_tables, seq_lens, scale, window: int | None = None,
                                     softcap: float | None = None) -> torch.Tensor:
    cu = torch.arange(q.shape[0] + 1)
    return paged_attention_varlen_reference(q, kv_cache, block_tables, seq_lens, cu, scale, window, softcap)
