"""Times each Triton kernel against its torch reference on a CUDA device and reports the
achieved memory bandwidth against the device's measured copy bandwidth.

  python -m llmserve.bench.kernels

Shapes are SmolLM2-135M-like (9 query heads, 3 KV heads, head_dim 64, hidden 576,
vocab 49152), fp16. Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from llmserve.contract.arith import cdiv

H, KVH, D, HIDDEN, VOCAB, BS = 9, 3, 64, 576, 49152, 16


def cuda_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(nbytes: int = 1 << 28) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / (cuda_ms(lambda: y.copy_(x)) / 1e3)


def _attention_case(seq_lens: list[int], query_lens: list[int]):
    from llmserve.worker.attention.torch_paged import TorchPagedAttention
    from llmserve.worker.attention.triton_backend import TritonPagedAttention

    dev, dt = torch.device("cuda"), torch.float16
    n_blocks = sum(cdiv(n, BS) for n in seq_lens)
    perm = torch.randperm(n_blocks).tolist()
    tables, slots, i = [], [], 0
    for L, q in zip(seq_lens, query_lens):
        t = perm[i : i + cdiv(L, BS)]
        i += len(t)
        tables.append(t)
        slots += [t[p // BS] * BS + p % BS for p in range(L - q, L)]
    T = sum(query_lens)
    kv = torch.randn(2, n_blocks, BS, KVH, D, dtype=dt, device=dev)
    q, k, v = (torch.randn(T, h, D, dtype=dt, device=dev) for h in (H, KVH, KVH))
    slot_mapping = torch.tensor(slots, device=dev)
    fns = []
    for cls in (TritonPagedAttention, TorchPagedAttention):
        meta = cls.build_metadata(query_lens, seq_lens, tables, slot_mapping, BS)
        if cls is TorchPagedAttention:  # its metadata is built on the host
            meta.decode_block_table = meta.decode_block_table.to(dev) if meta.decode_block_table is not None else None
            for p in meta.prefills:
                p.block_ids = p.block_ids.to(dev)
                p.mask = p.mask.to(dev) if p.mask is not None else None
        attn = cls(H, D, KVH)
        fns.append(lambda attn=attn, meta=meta: attn.forward(q, k, v, kv, meta))
    # K/V of every context token read once, q/out and the new k/v once
    nbytes = 2 * sum(seq_lens) * KVH * D * 2 + T * (2 * H + 4 * KVH) * D * 2
    return fns[0], fns[1], nbytes


def _cases():
    from llmserve.kernels import triton as K
    from llmserve.kernels.triton import kv_cache, norm, rotary, sampling

    dev, dt = torch.device("cuda"), torch.float16
    yield ("decode 64 x 1024 ctx", *_attention_case([1024] * 64, [1] * 64))
    yield ("decode split-K 4 x 8192 ctx", *_attention_case([8192] * 4, [1] * 4))
    yield ("prefill 4 x 512", *_attention_case([512] * 4, [512] * 4))

    T = 4096
    kvc = torch.zeros(2, T // BS, BS, KVH, D, dtype=dt, device=dev)
    k, v = torch.randn(T, KVH, D, dtype=dt, device=dev), torch.randn(T, KVH, D, dtype=dt, device=dev)
    slots = torch.randperm(T, device=dev)
    yield ("reshape_and_cache 4096 tok", lambda: K.reshape_and_cache(k, v, kvc, slots),
           lambda: kv_cache.reshape_and_cache_reference(k, v, kvc, slots), 4 * T * KVH * D * 2)

    x, r = torch.randn(T, HIDDEN, dtype=dt, device=dev), torch.randn(T, HIDDEN, dtype=dt, device=dev)
    w = torch.randn(HIDDEN, dtype=dt, device=dev)
    yield ("rms_norm+residual 4096 x 576", lambda: K.rms_norm(x, w, 1e-5, r),
           lambda: norm.rms_norm_reference(x, w, 1e-5, r), 4 * T * HIDDEN * 2)

    qkv = torch.randn(T, H + 2 * KVH, D, dtype=dt, device=dev)
    q, kk = qkv[:, :H], qkv[:, H : H + KVH]
    cos, sin = torch.randn(8192, D // 2, dtype=dt, device=dev), torch.randn(8192, D // 2, dtype=dt, device=dev)
    pos = torch.randint(0, 8192, (T,), device=dev)
    yield ("rotary (neox) 4096 tok", lambda: K.rotary_embedding(pos, q, kk, cos, sin),
           lambda: rotary.rotary_embedding_reference(pos, q, kk, cos, sin), 2 * T * (H + KVH) * D * 2)

    logits = torch.randn(64, VOCAB, device=dev)
    top_k = torch.randint(0, 100, (64,), device=dev)
    top_p = torch.rand(64, device=dev)
    yield ("top_k_top_p 64 x 49152 fp32", lambda: K.top_k_top_p_filter(logits, top_k, top_p),
           lambda: sampling.top_k_top_p_filter_reference(logits, top_k, top_p), 2 * logits.numel() * 4)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device present: nothing to benchmark (the kernels are tested on CPU under "
              "TRITON_INTERPRET=1 by tests/kernels)")
        return 0
    torch.manual_seed(0)
    peak = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; measured copy bandwidth {peak / 1e9:.0f} GB/s")
    print(f"{'kernel':34s} {'triton ms':>10s} {'torch ms':>10s} {'speedup':>8s} {'GB/s':>8s} {'% copy':>7s}")
    for name, triton_fn, torch_fn, nbytes in _cases():
        t_ms, r_ms = cuda_ms(triton_fn), cuda_ms(torch_fn)
        bw = nbytes / (t_ms / 1e3)
        print(f"{name:34s} {t_ms:10.3f} {r_ms:10.3f} {r_ms / t_ms:7.2f}x {bw / 1e9:8.1f} {100 * bw / peak:6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
