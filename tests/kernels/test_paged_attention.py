"""Paged attention kernels vs their torch reference, and the reference vs dense SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels.triton.paged_attention import (
    paged_attention_decode, paged_attention_decode_reference, paged_attention_varlen,
    paged_attention_varlen_reference,
)
from tests.kernels.helpers import DTYPES, TOL, make_case, rel_err

# (kv heads, query heads per kv head): GQA ratios 1, 3, 4
HEADS = [(2, 1), (1, 3), (2, 4)]


def dense_reference(case) -> torch.Tensor:
    """Causal SDPA on each sequence's contiguous K/V: no block table involved."""
    outs = []
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        s, e = case.cu_seqlens_q[i].item(), case.cu_seqlens_q[i + 1].item()
        L, n = k.shape[0], e - s
        mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]  # [n, L]
        o = F.scaled_dot_product_attention(
            case.q[s:e].cpu().float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
            attn_mask=mask, scale=case.scale, enable_gqa=True,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("kvh,g", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_matches_dense_sdpa(kvh, g, block_size):
    # decode rows, a fresh prefill, chunks after cached context (prefix hit / chunked prefill)
    case = make_case([1, 33, 40, 97, 64], [1, 1, 40, 25, 17], kvh, g, 64, block_size, torch.float32, "cpu", seed=g)
    ref = paged_attention_varlen_reference(case.q, case.kv_cache, case.block_tables, case.seq_lens,
                                           case.cu_seqlens_q, case.scale)
    assert rel_err(ref, dense_reference(case)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kvh,g", HEADS)
def test_decode(kvh, g, block_size, head_dim, dtype, device):
    seq_lens = [1, 17, 50, 95]  # partial last blocks, one exact block boundary miss each
    case = make_case(seq_lens, [1] * 4, kvh, g, head_dim, block_size, dtype, device, seed=block_size + g)
    out = torch.full_like(case.q, float("nan"))
    paged_attention_decode(case.q, case.kv_cache, case.block_tables, case.seq_lens, case.scale, out=out)
    ref = paged_attention_decode_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_tables.cpu(),
                                           case.seq_lens.cpu(), case.scale)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_decode_split_k(num_splits, dtype, device):
    # Each sequence's 64-key tiles are shared by the splits: 333 keys are 6 tiles (2 or 3
    # splits each take several), and the short ones leave splits empty, weighing nothing.
    case = make_case([3, 64, 99, 333], [1] * 4, 1, 3, 64, 16, dtype, device, seed=num_splits)
    out = torch.full_like(case.q, float("nan"))
    paged_attention_decode(case.q, case.kv_cache, case.block_tables, case.seq_lens, case.scale,
                           num_splits=num_splits, out=out)
    ref = paged_attention_decode_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_tables.cpu(),
                                           case.seq_lens.cpu(), case.scale)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kvh,g", HEADS)
def test_varlen_prefill_mixed(kvh, g, block_size, head_dim, dtype, device):
    # a decode-like row, a fresh odd prefill, two chunks on top of cached context
    seq_lens, query_lens = [9, 37, 70, 45], [1, 37, 23, 6]
    _check_varlen(make_case(seq_lens, query_lens, kvh, g, head_dim, block_size, dtype, device, seed=head_dim + g),
                  TOL[dtype])


def _check_varlen(case, tol: float) -> None:
    """The kernel over every row of the case (none left NaN) against the reference."""
    out = torch.full_like(case.q, float("nan"))
    paged_attention_varlen(case.q, case.kv_cache, case.block_tables, case.seq_lens, case.cu_seqlens_q,
                           max(case.query_lens), case.scale, out=out)
    ref = paged_attention_varlen_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_tables.cpu(),
                                           case.seq_lens.cpu(), case.cu_seqlens_q.cpu(), case.scale)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), ref) <= tol


@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 4), (128, 32, 4), (64, 16, 8)])
def test_varlen_long_prompts_span_many_key_tiles(head_dim, block_size, group, device):
    # Key tiles of 64 (head dim 64) or 32 (128; or 128-row q tiles, group 8) keys gathered
    # across blocks: a 300-token prompt is 5-10 tiles, a 77-token chunk over 123 cached
    # keys starts mid-tile, and the q tiles' causal diagonals fall inside key tiles.
    seq_lens, query_lens = [300, 200, 129], [300, 77, 1]
    _check_varlen(make_case(seq_lens, query_lens, 2, group, head_dim, block_size, torch.float32, device,
                            seed=head_dim), TOL[torch.float32])


def test_varlen_sub_batch_leaves_other_rows(device):
    """Rows before the first sequence (the decode rows in the backend) stay untouched."""
    case = make_case([5, 30], [1, 12], 1, 2, 64, 16, torch.float32, device)
    out = torch.full_like(case.q, float("nan"))
    paged_attention_varlen(case.q, case.kv_cache, case.block_tables[1:], case.seq_lens[1:],
                           case.cu_seqlens_q[1:], 12, case.scale, out=out)
    ref = paged_attention_varlen_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_tables.cpu(),
                                           case.seq_lens.cpu(), case.cu_seqlens_q.cpu(), case.scale)
    assert out[0].isnan().all()
    assert rel_err(out[1:].cpu(), ref[1:]) <= 1e-5


def test_wrappers_reject_bad_arguments(device):
    case = make_case([20], [1], 2, 2, 64, 16, torch.float32, device)
    args = (case.kv_cache, case.block_tables, case.seq_lens, case.scale)
    with pytest.raises(ValueError, match="dtype mismatch"):
        paged_attention_decode(case.q.half(), *args)
    with pytest.raises(ValueError, match="block_tables dtype"):
        paged_attention_decode(case.q, case.kv_cache, case.block_tables.float(), case.seq_lens, case.scale)
    with pytest.raises(ValueError, match="seq_lens shape"):
        paged_attention_decode(case.q, case.kv_cache, case.block_tables, case.seq_lens.repeat(2), case.scale)
    with pytest.raises(ValueError, match="unit stride"):
        paged_attention_decode(case.q.transpose(1, 2).contiguous().transpose(1, 2), *args)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_decode(case.q[:, :3], *args)
    with pytest.raises(ValueError, match="out shape"):
        paged_attention_decode(case.q, *args, out=case.q[:, :2])
    with pytest.raises(ValueError, match="cu_seqlens_q shape"):
        paged_attention_varlen(case.q, case.kv_cache, case.block_tables, case.seq_lens, case.seq_lens, 1, 1.0)
    small = torch.zeros(2, 4, 8, 2, 64)
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        paged_attention_varlen(case.q.cpu(), small, case.block_tables.cpu(), case.seq_lens.cpu(),
                               case.cu_seqlens_q.cpu(), 1, 1.0)


def test_key_tile_keeps_a_tile_s_keys_within_the_register_budget():
    from llmserve.kernels.triton.paged_attention import key_tile

    assert key_tile(64, 16) == 64  # the case measured on the H200: 4 blocks a tile
    assert key_tile(128, 16) == 32 and key_tile(256, 16) == 16  # 4096 elements of K a tile
    assert key_tile(256, 32) == 32 and key_tile(64, 128) == 128  # never less than one block
    assert key_tile(512, 8) == 16  # tl.dot's least


def test_the_prefill_key_tile_keeps_its_score_tile_within_the_same_budget():
    from llmserve.kernels.triton.paged_attention import varlen_key_tile, varlen_tile

    assert varlen_tile(4) == (64, 16) and varlen_key_tile(64, 16, 64) == 64  # Llama 3's 4 heads a KV head
    assert varlen_tile(8) == (128, 16) and varlen_key_tile(64, 16, 128) == 32  # 128 x 32 scores
    assert varlen_key_tile(128, 16, 64) == 32 and varlen_key_tile(64, 16, 512) == 16  # never under tl.dot's 16


def _poison_before_windows(case, window: int) -> torch.Tensor:
    """The block table with every entry wholly before a sequence's first query's window
    pointing at a NaN block (what a freed, reused block may hold): no kernel may read it."""
    kv, bs = case.kv_cache, case.kv_cache.shape[2]
    case.kv_cache = torch.cat([kv, torch.full_like(kv[:, :1], float("nan"))], dim=1)
    nan_block = kv.shape[1]
    table = case.block_tables.clone()
    for i, (L, n) in enumerate(zip(case.seq_lens.tolist(), case.query_lens)):
        first_key = max(0, L - n - window + 1)
        table[i, : first_key // bs] = nan_block
    return table


# (window, softcap): window only, soft-cap only, both; window 20 cuts blocks of 16 mid-way
WINDOW_SOFTCAP = [(20, None), (None, 2.0), (37, 3.0)]


@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window_softcap(window, softcap, num_splits, device):
    seq_lens = [5, 20, 21, 99, 170]  # shorter than, equal to and past the window
    case = make_case(seq_lens, [1] * 5, 2, 3, 64, 16, torch.float32, device, seed=7)
    ref = paged_attention_decode_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_tables.cpu(),
                                           case.seq_lens.cpu(), case.scale, window, softcap)
    table = _poison_before_windows(case, window) if window else case.block_tables
    out = paged_attention_decode(case.q, case.kv_cache, table, case.seq_lens, case.scale, num_splits=num_splits,
                                 window=window, softcap=softcap)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), ref) <= TOL[torch.float32]


@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
def test_varlen_window_softcap(window, softcap, device):
    # a decode-like row, fresh prefills longer than the window (one of several key
    # tiles, whose first tiles lie wholly before later queries' windows), chunks over
    # cached context
    seq_lens, query_lens = [50, 70, 90, 45, 200], [1, 70, 23, 6, 200]
    case = make_case(seq_lens, query_lens, 2, 2, 64, 16, torch.float32, device, seed=11)
    ref = paged_attention_varlen_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_tables.cpu(),
                                           case.seq_lens.cpu(), case.cu_seqlens_q.cpu(), case.scale, window, softcap)
    table = _poison_before_windows(case, window) if window else case.block_tables
    out = paged_attention_varlen(case.q, case.kv_cache, table, case.seq_lens, case.cu_seqlens_q, max(query_lens),
                                 case.scale, window=window, softcap=softcap)
    assert not out.isnan().any()
    assert rel_err(out.cpu(), ref) <= TOL[torch.float32]


def test_reference_window_softcap_matches_dense():
    """The reference's window and soft-cap against a dense masked computation written out."""
    case = make_case([40], [12], 1, 2, 16, 16, torch.float32, "cpu", seed=3)
    ref = paged_attention_varlen_reference(case.q, case.kv_cache, case.block_tables, case.seq_lens,
                                           case.cu_seqlens_q, case.scale, 8, 2.0)
    k, v = case.keys[0].repeat_interleave(2, dim=1), case.values[0].repeat_interleave(2, dim=1)  # [40, 2, 16]
    s = torch.einsum("nhd,lhd->hnl", case.q, k) * case.scale
    s = 2.0 * torch.tanh(s / 2.0)
    q_pos, k_pos = torch.arange(28, 40)[:, None], torch.arange(40)[None, :]
    s = s.masked_fill((k_pos > q_pos) | (k_pos <= q_pos - 8), float("-inf"))
    assert rel_err(ref, torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)) < 1e-6
