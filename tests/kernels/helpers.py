"""Random paged-attention cases: shuffled, non-contiguous block ids; block tables padded
with junk ids past each sequence's last block; garbage in every unused cache row."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor  # [N, max_blocks] int32
    seq_lens: torch.Tensor  # [N] int32
    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    keys: list[torch.Tensor]  # per sequence, contiguous [L, KVH, D]
    values: list[torch.Tensor]
    query_lens: list[int]
    scale: float


def make_case(seq_lens, query_lens, num_kv_heads, group, head_dim, block_size, dtype, device, seed=0) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(need) + 5  # a few blocks nobody owns
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    max_blocks = max(need) + 2
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables, keys, values, i = [], [], [], 0
    for L, n in zip(seq_lens, need):
        own = ids[i : i + n]
        i += n
        tables.append(own + [rng.randrange(num_blocks) for _ in range(max_blocks - n)])
        k = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(L):
            kv[0, own[p // block_size], p % block_size] = k[p]
            kv[1, own[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    i32 = dict(dtype=torch.int32, device=device)
    return PagedCase(
        q=q.to(device), kv_cache=kv.to(device), block_tables=torch.tensor(tables, **i32),
        seq_lens=torch.tensor(seq_lens, **i32), cu_seqlens_q=torch.tensor(cu, **i32),
        keys=keys, values=values, query_lens=list(query_lens), scale=head_dim**-0.5,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# The dtypes every kernel is checked in: bfloat16 too on CUDA. (Triton's CPU interpreter
# has no bfloat16 dot products: its paged-attention output in bfloat16 is garbage.)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
