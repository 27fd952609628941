"""TorchPagedAttention's metadata builds the torch fallbacks' pieces (the decode rows'
mask, each prefill row's PrefillSeq) only when a layer takes a fallback: a step the C++
kernels run never builds them, and the fallbacks, building them, give the kernels' output."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.attention.torch_paged import TorchPagedAttention

BS, KVH, G, D = 4, 2, 2, 32
# Two decode rows, then a fresh prefill and a chunk after 6 cached tokens: (query_len, seq_len)
ROWS = [(1, 5), (1, 9), (3, 3), (4, 10)]


def _step(seed: int = 0):
    """(q, k, v, a cache holding every row's earlier keys, metadata) of ROWS in float32."""
    gen = torch.Generator().manual_seed(seed)
    tables, next_block = [], 0
    for _, seq_len in ROWS:
        n = -(-seq_len // BS)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    cache = torch.randn(2, next_block, BS, KVH, D, generator=gen)
    slots = [t[p // BS] * BS + p % BS for (q_len, n), t in zip(ROWS, tables) for p in range(n - q_len, n)]
    T = len(slots)
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (KVH * G, KVH, KVH))
    meta = TorchPagedAttention.build_metadata([q_len for q_len, _ in ROWS], [n for _, n in ROWS], tables,
                                              torch.tensor(slots), BS)
    return q, k, v, cache, meta


@pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")
def test_the_kernels_step_builds_no_fallback_pieces_and_the_fallbacks_agree(monkeypatch):
    attention = TorchPagedAttention(KVH * G, D, KVH)
    q, k, v, cache, meta = _step()
    kernels_out = attention.forward(q, k, v, cache.clone(), meta)
    assert meta._decode_mask is None and meta._prefills is None

    monkeypatch.setattr(cpu_kernels, "load", lambda: False)  # every layer takes the torch fallbacks
    q, k, v, cache, meta = _step()
    fallback_out = attention.forward(q, k, v, cache, meta)
    assert meta._decode_mask is not None and [p.token_start for p in meta.prefills] == [2, 5]
    assert meta.prefills is meta.prefills  # built once, kept for the step's other layers
    torch.testing.assert_close(fallback_out, kernels_out, rtol=1e-5, atol=1e-5)


def test_the_decode_mask_shows_each_row_its_own_keys():
    *_, meta = _step()
    mask = meta.decode_mask  # [2, 1, 1, widest table * BS]
    assert mask.shape == (2, 1, 1, meta.decode_block_table.shape[1] * BS)
    assert mask[:, 0, 0].sum(-1).tolist() == [5, 9] and mask[0, 0, 0, :5].all() and mask[1, 0, 0, :9].all()
