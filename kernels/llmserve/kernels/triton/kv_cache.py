"""KV cache writes (Triton). (Block copies and swaps are the worker's BlockMover.)

reshape_and_cache: token t's k/v [KVH, D] go to slot slot_mapping[t] of the cache
[2, num_blocks, block_size, KVH, D] (block slot // block_size, row slot % block_size);
slot -1 = skip (padding tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.triton._checks import FLOAT_DTYPES, INDEX_DTYPES, check_same_dtype, check_shape, check_tensor, next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    KVH: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    n_heads = tl.where(slot >= 0, KVH, 0)  # slot -1: every lane masked off
    mask = (h < n_heads)[:, None] & (d < D)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D]; slot_mapping: [T].
    NOTE: slots are not range-checked here (that needs a device sync): the worker's input
    batch validates block ids before building the slot mapping."""
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=FLOAT_DTYPES)
    dev = kv_cache.device
    check_tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("v", v, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_same_dtype(k=k, v=v, kv_cache=kv_cache)
    two, _, bs, KVH, D = kv_cache.shape
    if two != 2:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} is not [2, blocks, block_size, kv_heads, head_dim]")
    T = k.shape[0]
    check_shape("k", k, (T, KVH, D))
    check_shape("v", v, (T, KVH, D))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=dev)
    check_shape("slot_mapping", slot_mapping, (T,))
    if T == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(T,)](
        k, v, kc, vc, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        KVH=KVH, H_PAD=next_pow2(KVH), D=D, D_PAD=next_pow2(D), BLOCK_SIZE=bs, num_warps=1,
    )


def reshape_and_cache_reference(k, v, kv_cache, slot_mapping) -> None:
    _, nb, bs, KVH, D = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat = kv_cache.view(2, nb * bs, KVH, D)
    flat[0].index_copy_(0, slots, k[keep])
    flat[1].index_copy_(0, slots, v[keep])
