"""The C++ CPU decode kernel against the plain-torch gather + SDPA path, and both
against dense attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.attention.torch_paged import TorchPagedAttention


def paged_case(seq_lens, kvh, g, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 5
    cache = torch.randn(2, num_blocks, block_size, kvh, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()  # Shuffled, non-contiguous blocks.
    tables = [[ids.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    q = torch.randn(len(seq_lens), kvh * g, head_dim, generator=gen).to(dtype)
    return q, cache, tables


def dense_reference(q, cache, tables, seq_lens, block_size):
    """Attention over each sequence's K/V laid out contiguously (no paging involved)."""
    outs = []
    for b, n in enumerate(seq_lens):
        kv = torch.cat([cache[:, blk] for blk in tables[b]], dim=1)[:, :n].float()  # [2, n, KVH, D]
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [KVH, n, D]
        g = q.shape[1] // k.shape[0]
        qq = q[b].float().view(k.shape[0], g, -1)
        outs.append(F.scaled_dot_product_attention(qq, k, v).reshape(q.shape[1], -1))
    return torch.stack(outs)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# g = 6 and 7: more query heads per KV head than the tiled kernel keeps in registers at once
# (5 at D=64, 2 at D=128); block 8: fewer rows than one 16-row score tile; D=96: no tile.
@pytest.mark.parametrize("g", [1, 3, 4, 6, 7])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128), (8, 64), (16, 96)])
# Many sequences: one work item per sequence; one: split by KV head across threads.
@pytest.mark.parametrize("seq_lens", [[1, 17, 40, 129, 5], [300]])
def test_cpu_decode_kernel_matches_gather_path_and_dense(dtype, tol, g, block_size, head_dim, seq_lens):
    kvh = 2
    q, cache, tables = paged_case(seq_lens, kvh, g, head_dim, block_size, dtype)
    backend = TorchPagedAttention(kvh * g, head_dim, kvh)
    meta = TorchPagedAttention.build_metadata([1] * len(seq_lens), seq_lens, tables,
                                              torch.zeros(len(seq_lens), dtype=torch.long), block_size)
    out = torch.full_like(q, float("nan"))
    out[:] = cpu_kernels.paged_attention_decode(q, cache, meta.decode_block_table, meta.decode_seq_lens, backend.scale)
    gathered = backend._decode_gather(q, cache, meta)
    dense = dense_reference(q, cache, tables, seq_lens, block_size)
    for got in (out.float(), gathered.float()):
        assert not got.isnan().any()
        assert (got - dense).norm() / dense.norm() <= tol


def windowed_reference(q, cache, tables, seq_lens, window, softcap, scale):
    """Dense attention of each row's last query over its last `window` keys, soft-capped."""
    outs = []
    for b, n in enumerate(seq_lens):
        kv = torch.cat([cache[:, blk] for blk in tables[b]], dim=1)[:, :n].float()  # [2, n, KVH, D]
        first = max(0, n - window) if window else 0
        k, v = kv[0, first:].transpose(0, 1), kv[1, first:].transpose(0, 1)  # [KVH, keys, D]
        qq = q[b].float().view(k.shape[0], q.shape[1] // k.shape[0], -1)  # [KVH, g, D]
        s = qq @ k.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        outs.append((s.softmax(-1) @ v).reshape(q.shape[1], -1))
    return torch.stack(outs)


def windowed_case(seq_lens, kvh, g, head_dim, block_size, dtype, seed, window, softcap):
    """A paged case, its windowed reference, and its decode metadata; the blocks wholly
    before a row's window are NaN (freed and reused), so a read of one shows."""
    q, cache, tables = paged_case(seq_lens, kvh, g, head_dim, block_size, dtype, seed=seed)
    ref = windowed_reference(q, cache, tables, seq_lens, window, softcap, head_dim**-0.5)
    if window:
        for t, n in zip(tables, seq_lens):
            for blk in t[: max(0, n - window) // block_size]:
                cache[:, blk] = float("nan")
    meta = TorchPagedAttention.build_metadata([1] * len(seq_lens), seq_lens, tables,
                                              torch.zeros(len(seq_lens), dtype=torch.long), block_size)
    return q, cache, ref, meta


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (4, 16)])  # tiled, and a 4-row block past 16 rows
@pytest.mark.parametrize("window,softcap", [(20, None), (None, 2.0), (7, 3.0)])
@pytest.mark.parametrize("seq_lens", [[1, 7, 20, 21, 130], [300]])
def test_cpu_decode_kernel_window_softcap(dtype, tol, block_size, head_dim, window, softcap, seq_lens):
    """Blocks wholly before a row's window are NaN (freed and reused): neither the kernel
    nor the gather path may read them."""
    kvh, g = 2, 3
    q, cache, ref, meta = windowed_case(seq_lens, kvh, g, head_dim, block_size, dtype, 5, window, softcap)
    backend = TorchPagedAttention(kvh * g, head_dim, kvh, sliding_window=window, softcap=softcap)
    out = cpu_kernels.paged_attention_decode(q, cache, meta.decode_block_table, meta.decode_seq_lens, backend.scale,
                                             window, softcap)
    for got in (out.float(), backend._decode_gather(q, cache, meta).float()):
        assert not got.isnan().any()
        assert (got - ref).norm() / ref.norm() <= tol


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (8, 64), (16, 96)])
# 3 and 5 threads with 2 KV heads: the keys of each sequence are cut into chunks (some of
# them empty for the 1- and 5-token sequences), merged after.
@pytest.mark.parametrize("threads", [3, 5], indirect=True)
# Window 100: the chunks cut the window's blocks, the first starting mid-block; window 7: too
# few blocks to cut.
@pytest.mark.parametrize("window,softcap", [(None, None), (100, None), (100, 3.0), (7, 3.0)])
@pytest.mark.parametrize("seq_lens", [[1, 17, 40, 129, 5], [300]])
def test_cpu_decode_kernel_key_chunks_match_dense(dtype, tol, block_size, head_dim, threads, window, softcap,
                                                  seq_lens):
    kvh, g = 2, 3
    q, cache, ref, meta = windowed_case(seq_lens, kvh, g, head_dim, block_size, dtype, 7, window, softcap)
    out = cpu_kernels.paged_attention_decode(q, cache, meta.decode_block_table, meta.decode_seq_lens,
                                             head_dim**-0.5, window, softcap).float()
    assert not out.isnan().any()
    assert (out - ref).norm() / ref.norm() <= tol
    torch.set_num_threads(1)  # one item per sequence and its whole keys: the same sums, unchunked
    single = cpu_kernels.paged_attention_decode(q, cache, meta.decode_block_table, meta.decode_seq_lens,
                                                head_dim**-0.5, window, softcap).float()
    assert (out - single).norm() / single.norm() <= tol / 4


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_reads_q_as_a_view_of_the_fused_projection(dtype):
    """q is the first H heads of each row of qkv [B, (H + 2 KVH) * D]: read at that row
    stride, not copied, with the same result as a contiguous q."""
    seq_lens, kvh, g, head_dim, block_size = [1, 17, 40, 129, 5], 2, 3, 64, 16
    q, cache, tables = paged_case(seq_lens, kvh, g, head_dim, block_size, dtype, seed=11)
    B, H = q.shape[:2]
    qkv = torch.randn(B, (H + 2 * kvh) * head_dim).to(dtype)
    qkv[:, : H * head_dim] = q.reshape(B, -1)
    view = qkv[:, : H * head_dim].view(B, H, head_dim)
    assert not view.is_contiguous()
    meta = TorchPagedAttention.build_metadata([1] * B, seq_lens, tables, torch.zeros(B, dtype=torch.long), block_size)
    args = (cache, meta.decode_block_table, meta.decode_seq_lens, head_dim**-0.5)
    got = cpu_kernels.paged_attention_decode(view, *args)
    assert got.is_contiguous() and torch.equal(got, cpu_kernels.paged_attention_decode(q, *args))
    assert (got.float() - dense_reference(q, cache, tables, seq_lens, block_size)).abs().max() < 0.05
