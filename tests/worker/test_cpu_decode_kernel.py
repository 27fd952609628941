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
