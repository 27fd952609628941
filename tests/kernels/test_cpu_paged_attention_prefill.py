"""The C++ CPU prefill attention kernel against the plain-torch path it replaces
(`TorchPagedAttention._prefill`: gather + SDPA, the fallback), and both against dense
attention over contiguous K/V computed here in float64."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.attention.torch_paged import TorchPagedAttention

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # as the decode kernel's tests
# (query_len, context_len) per prefill row. A 1-token row after a longer one is a prefill
# row (decode rows only lead the step).
FRESH = [(2, 0), (1, 0), (17, 0), (64, 0), (300, 0)]
CHUNKS = [(5, 40), (1, 7), (64, 17), (300, 100), (33, 250)]


def paged_prefill_case(rows, kvh, g, head_dim, block_size, dtype, seed=0, unused=float("nan")):
    """q [T, H, D], a cache holding every row's keys in shuffled blocks with `unused` in
    every other slot (unused blocks, rows past a sequence's end), and the tables."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in rows]
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    cache = torch.full((2, num_blocks, block_size, kvh, head_dim), unused, dtype=dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[ids.pop() for _ in range(n)] for n in need]
    for t, n in zip(tables, seq_lens):
        for p in range(n):
            cache[:, t[p // block_size], p % block_size] = torch.randn(2, kvh, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(q for q, _ in rows), kvh * g, head_dim, generator=gen).to(dtype)
    return q, cache, tables, seq_lens


def dense_reference(q, cache, tables, rows, block_size, scale, window=None, softcap=None):
    """Each row's queries (positions ctx..ctx+q_len-1) over its keys laid out contiguously."""
    outs, start = [], 0
    for table, (q_len, ctx) in zip(tables, rows):
        n = ctx + q_len
        kv = torch.cat([cache[:, blk] for blk in table], dim=1)[:, :n].double()  # [2, n, KVH, D]
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [KVH, n, D]
        g = q.shape[1] // k.shape[0]
        qq = q[start : start + q_len].double().transpose(0, 1)  # [H, q_len, D]
        s = qq @ k.repeat_interleave(g, 0).transpose(1, 2) * scale  # [H, q_len, n]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qp, kp = torch.arange(ctx, n)[:, None], torch.arange(n)[None, :]
        visible = (kp <= qp) & ((kp > qp - window) if window else True)
        s = s.masked_fill(~visible, float("-inf"))
        outs.append((s.softmax(-1) @ v.repeat_interleave(g, 0)).transpose(0, 1))  # [q_len, H, D]
        start += q_len
    return torch.cat(outs)


def run_both(q, cache, tables, seq_lens, rows, block_size, backend):
    """(kernel output, torch-path output) for the step's prefill rows."""
    meta = TorchPagedAttention.build_metadata([r[0] for r in rows], seq_lens, tables,
                                              torch.zeros(q.shape[0], dtype=torch.long), block_size)
    assert meta.num_decodes == 0
    got = cpu_kernels.paged_attention_prefill(q, cache, meta.prefill_block_table, meta.prefill_query_start,
                                              meta.prefill_seq_lens, backend.scale, backend.sliding_window,
                                              backend.softcap)
    # The torch path reads this step's keys from k and v when a row has no context.
    k, v = torch.empty(2, q.shape[0], backend.num_kv_heads, q.shape[2], dtype=q.dtype)
    for table, (q_len, ctx), p in zip(tables, rows, meta.prefills):
        for i, pos in enumerate(range(ctx, ctx + q_len)):
            k[p.token_start + i], v[p.token_start + i] = cache[:, table[pos // block_size], pos % block_size]
    torch_path = torch.cat([backend._prefill(q, k, v, cache, p) for p in meta.prefills])
    return got, torch_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 64), (16, 128), (32, 128)])
@pytest.mark.parametrize("rows", [FRESH, CHUNKS], ids=["fresh", "chunks"])
def test_cpu_prefill_kernel_matches_torch_path_and_dense(dtype, g, block_size, head_dim, rows):
    kvh = 2
    q, cache, tables, seq_lens = paged_prefill_case(rows, kvh, g, head_dim, block_size, dtype)
    backend = TorchPagedAttention(kvh * g, head_dim, kvh)
    got, torch_path = run_both(q, cache, tables, seq_lens, rows, block_size, backend)
    dense = dense_reference(q, cache, tables, rows, block_size, backend.scale)
    for out in (got, torch_path):
        assert not out.isnan().any()
        assert (out.double() - dense).norm() / dense.norm() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(20, None), (None, 2.0), (7, 3.0), (100, None)])
@pytest.mark.parametrize("rows", [FRESH, CHUNKS], ids=["fresh", "chunks"])
def test_cpu_prefill_kernel_window_softcap(dtype, window, softcap, rows):
    """Blocks wholly before a chunk's first window are NaN (freed and reused): neither the
    kernel nor the torch path may read them."""
    kvh, g, block_size, head_dim = 2, 3, 16, 64
    q, cache, tables, seq_lens = paged_prefill_case(rows, kvh, g, head_dim, block_size, dtype, seed=3)
    backend = TorchPagedAttention(kvh * g, head_dim, kvh, sliding_window=window, softcap=softcap)
    dense = dense_reference(q, cache, tables, rows, block_size, backend.scale, window, softcap)
    if window:
        for table, (_, ctx) in zip(tables, rows):
            for blk in table[: max(0, ctx + 1 - window) // block_size]:
                cache[:, blk] = float("nan")
    got, torch_path = run_both(q, cache, tables, seq_lens, rows, block_size, backend)
    for out in (got, torch_path):
        assert not out.isnan().any()
        assert (out.double() - dense).norm() / dense.norm() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_kernel_portable_head_dim(dtype):
    """A head size off the AVX-512 BF16 tiles (not a multiple of 32) takes the float32 loops."""
    rows, kvh, g, block_size, head_dim = CHUNKS, 2, 4, 16, 80
    q, cache, tables, seq_lens = paged_prefill_case(rows, kvh, g, head_dim, block_size, dtype, seed=4)
    backend = TorchPagedAttention(kvh * g, head_dim, kvh, sliding_window=50)
    got, _ = run_both(q, cache, tables, seq_lens, rows, block_size, backend)
    dense = dense_reference(q, cache, tables, rows, block_size, backend.scale, 50)
    assert (got.double() - dense).norm() / dense.norm() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_mixed_step_matches_without_kernels(dtype, monkeypatch):
    """A step of decode rows and prefill rows through `forward`, with the kernels (the
    prefill rows take the new one) and with them unavailable (plain torch throughout)."""
    kvh, g, block_size, head_dim = 3, 3, 16, 64
    rows = [(1, 30), (1, 5), (40, 0), (1, 9), (70, 33)]  # decodes lead; the later 1-token row is a chunk
    # (The torch decode path reads whole blocks and masks the rows past a sequence's end: 0 there, not NaN.)
    q, cache, tables, seq_lens = paged_prefill_case(rows, kvh, g, head_dim, block_size, dtype, seed=7, unused=0.0)
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size
                          for t, (q_len, ctx) in zip(tables, rows) for p in range(ctx, ctx + q_len)])
    k, v = cache.view(2, -1, kvh, head_dim)[:, slots].unbind(0)  # this step's keys, as the layer computed them
    backend = TorchPagedAttention(kvh * g, head_dim, kvh)
    meta = TorchPagedAttention.build_metadata([r[0] for r in rows], seq_lens, tables, slots, block_size)
    assert meta.num_decodes == 2 and len(meta.prefills) == 3
    assert backend.prefill_kernel_applies(q.dtype, cache.device) == (dtype == torch.float32 or
                                                                     cpu_kernels.prefill_bf16_dot_supported())
    with_kernels = backend.forward(q, k, v, cache.clone(), meta)
    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    without = backend.forward(q, k, v, cache.clone(), meta)
    dense = dense_reference(q, cache, tables, rows, block_size, backend.scale)
    for out in (with_kernels, without):
        assert (out.double() - dense).norm() / dense.norm() <= TOLERANCE[dtype]


def test_cpu_prefill_kernel_refuses_bad_inputs():
    rows, block_size = [(5, 40), (64, 17)], 16
    q, cache, tables, seq_lens = paged_prefill_case(rows, 2, 3, 64, block_size, torch.float32)
    meta = TorchPagedAttention.build_metadata([r[0] for r in rows], seq_lens, tables,
                                              torch.zeros(q.shape[0], dtype=torch.long), block_size)
    args = (meta.prefill_block_table, meta.prefill_query_start, meta.prefill_seq_lens, 0.125)
    cpu_kernels.paged_attention_prefill(q, cache, *args)  # as given: accepted
    with pytest.raises(RuntimeError, match="dtypes differ"):
        cpu_kernels.paged_attention_prefill(q.bfloat16(), cache, *args)
    with pytest.raises(RuntimeError, match="cover q's rows"):
        cpu_kernels.paged_attention_prefill(q[:-1], cache, *args)
    with pytest.raises(RuntimeError, match="block table"):  # a table too narrow for its sequence
        cpu_kernels.paged_attention_prefill(q, cache, meta.prefill_block_table[:, :2].contiguous(), *args[1:])
    with pytest.raises(RuntimeError, match="bad query range"):  # more queries than tokens
        cpu_kernels.paged_attention_prefill(q, cache, args[0], args[1], torch.tensor([4, 81]), args[3])
