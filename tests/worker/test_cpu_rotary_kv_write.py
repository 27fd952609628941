"""The fused C++ rotary + paged KV-cache write against the torch path it replaces:
rotate q and k (apply_rotary), then index_copy_ k and v into their slots."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.attention import TorchPagedAttention
from llmserve.worker.attention.torch_paged import _write_kv
from llmserve.worker.layers import rotary
from llmserve.worker.layers.rotary import Rope, RotaryEmbedding, apply_rotary, rotary_kv_write_applies
from llmserve.worker.models.decoder import rotary_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler for the CPU kernels")

NUM_BLOCKS, BLOCK_SIZE = 40, 16
# (heads, kv_heads, head_dim, partial_rotary_factor): SmolLM2's GQA, MHA, Phi-4-mini's
# partial 0.75, one kv head with a quarter rotating.
SHAPES = [(9, 3, 64, 1.0), (4, 4, 128, 1.0), (8, 2, 64, 0.75), (6, 1, 96, 0.25)]


def reference(qkv, cos_sin, kv_cache, slots, heads, kv_heads, head_dim):
    """The torch path: the first R dims of each q and k head rotated, then two index_copy_
    (of the tokens with a slot: -1 is padding)."""
    T, R = qkv.shape[0], 2 * cos_sin[0].shape[-1]
    x = qkv.view(T, heads + 2 * kv_heads, head_dim)
    x[:, : heads + kv_heads, :R] = apply_rotary(x[:, : heads + kv_heads, :R], cos_sin)
    keep = slots >= 0
    _write_kv(x[keep, heads : heads + kv_heads], x[keep, heads + kv_heads :], kv_cache, slots[keep])


def case(rows, heads, kv_heads, head_dim, factor, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "partial_rotary_factor": factor}, dtype=dtype)
    cos_sin = rope(torch.randint(0, 4096, (rows,), generator=gen))
    qkv = (2 * torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)).to(dtype)
    # the cache holds other sequences' keys: a slot the step does not own must keep them
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:rows]  # scattered across blocks
    return qkv, cos_sin, kv_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("heads,kv_heads,head_dim,factor", SHAPES)
def test_rotary_and_kv_write_match_torch_exactly(dtype, rows, heads, kv_heads, head_dim, factor):
    qkv, cos_sin, kv_cache, slots = case(rows, heads, kv_heads, head_dim, factor, dtype, rows + heads)
    want_qkv, want_cache = qkv.clone(), kv_cache.clone()
    reference(want_qkv, cos_sin, want_cache, slots, heads, kv_heads, head_dim)

    cpu_kernels.rotary_and_write_kv_(qkv, cos_sin[0], cos_sin[1], kv_cache, slots, heads, kv_heads, head_dim)
    # NOTE: exact in bfloat16 too: each product is rounded to bfloat16 before the sum, as torch does.
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(kv_cache, want_cache)


def test_padding_tokens_are_rotated_and_stored_nowhere():
    """The CUDA-graph decode path pads its batch with slot -1 (and runs on CPU under
    Triton's interpreter in tests)."""
    heads, kv_heads, head_dim = 4, 2, 32
    qkv, cos_sin, kv_cache, slots = case(6, heads, kv_heads, head_dim, 1.0, torch.float32, 6)
    slots[3:] = -1
    want_qkv, want_cache = qkv.clone(), kv_cache.clone()
    reference(want_qkv, cos_sin, want_cache, slots, heads, kv_heads, head_dim)
    cpu_kernels.rotary_and_write_kv_(qkv, cos_sin[0], cos_sin[1], kv_cache, slots, heads, kv_heads, head_dim)
    assert torch.equal(qkv, want_qkv) and torch.equal(kv_cache, want_cache)


def test_rotation_reads_each_tokens_own_row_of_a_strided_qkv():
    """qkv as a view with a wider row stride (a slice of a larger projection output)."""
    heads, kv_heads, head_dim = 4, 2, 32
    qkv, cos_sin, kv_cache, slots = case(5, heads, kv_heads, head_dim, 1.0, torch.float32, 7)
    wide = torch.cat([qkv, torch.randn(5, 8)], dim=1)
    view = wide[:, : qkv.shape[1]]
    want_cache = kv_cache.clone()
    reference(qkv, cos_sin, want_cache, slots, heads, kv_heads, head_dim)
    cpu_kernels.rotary_and_write_kv_(view, cos_sin[0], cos_sin[1], kv_cache, slots, heads, kv_heads, head_dim)
    assert torch.equal(view, qkv) and torch.equal(kv_cache, want_cache)


def test_bad_arguments_are_refused_with_the_kernel_name():
    qkv, cos_sin, kv_cache, slots = case(3, 2, 1, 16, 1.0, torch.float32, 3)
    args = (2, 1, 16)
    cos, sin = cos_sin.cos, cos_sin.sin
    with pytest.raises(RuntimeError, match="rotary_and_write_kv: slot 640 of token 1"):
        cpu_kernels.rotary_and_write_kv_(qkv, cos, sin, kv_cache, torch.tensor([0, 640, 2]), *args)
    with pytest.raises(RuntimeError, match="rotary_and_write_kv: slot -2 of token 0"):
        cpu_kernels.rotary_and_write_kv_(qkv, cos, sin, kv_cache, torch.tensor([-2, 1, 2]), *args)
    with pytest.raises(RuntimeError, match="rotary_and_write_kv: cos, sin and kv_cache dtypes"):
        cpu_kernels.rotary_and_write_kv_(qkv, cos, sin, kv_cache.double(), slots, *args)
    with pytest.raises(RuntimeError, match="rotary_and_write_kv: qkv"):
        cpu_kernels.rotary_and_write_kv_(qkv, cos, sin, kv_cache, slots, 3, 1, 16)


def test_the_fused_path_applies_only_where_the_kernel_does():
    qkv, cos_sin, kv_cache, _ = case(3, 2, 1, 16, 1.0, torch.float32, 4)
    assert rotary_kv_write_applies(qkv, cos_sin, kv_cache)
    assert not rotary_kv_write_applies(qkv.half(), cos_sin, kv_cache.half())  # no float16 kernels
    assert not rotary_kv_write_applies(qkv, cos_sin, kv_cache.bfloat16())  # cache of another dtype
    tables = Rope(cos_sin.cos, cos_sin.sin, torch.arange(3))  # CUDA's form: tables + positions
    assert not rotary_kv_write_applies(qkv, tables, kv_cache)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_layer_output_and_cache_equal_the_unfused_path(monkeypatch, dtype, window):
    """Decode rows and a chunked prefill through `rotary_attention`, fused and in plain torch."""
    heads, kv_heads, head_dim = 8, 2, 64
    query_lens, seq_lens = [1, 1, 9, 40], [30, 5, 45, 40]  # two decodes, a chunk after 36 cached, a prompt
    tables = [[3, 7], [11], [0, 5, 9], [1, 2, 4]]
    slots = torch.tensor([tables[i][(n - q + j) // BLOCK_SIZE] * BLOCK_SIZE + (n - q + j) % BLOCK_SIZE
                          for i, (q, n) in enumerate(zip(query_lens, seq_lens)) for j in range(q)])
    qkv, cos_sin, kv_cache, _ = case(len(slots), heads, kv_heads, head_dim, 1.0, dtype, 5)
    meta = TorchPagedAttention.build_metadata(query_lens, seq_lens, tables, slots, BLOCK_SIZE)
    attn = TorchPagedAttention(heads, head_dim, kv_heads, sliding_window=window)
    got_cache = kv_cache.clone()
    got = rotary_attention(attn, qkv.clone(), cos_sin, got_cache, meta, heads, kv_heads, head_dim)

    monkeypatch.setattr(rotary, "fused_cpu_applies", lambda x: False)  # no C++ rotary at all
    want = rotary_attention(attn, qkv.clone(), cos_sin, kv_cache, meta, heads, kv_heads, head_dim)
    assert torch.equal(got_cache, kv_cache)
    assert torch.equal(got, want)
