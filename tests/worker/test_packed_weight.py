"""Packed CPU weights multiply like the dense weight at every row count, with and
without bias, for both libraries (float32: MKL or oneDNN, by CPU vendor; bfloat16:
oneDNN)."""

import pytest
import torch

from llmserve.worker.layers.linear import ReplicatedLinear
from llmserve.worker.layers.packed_weight import (FLOAT32_GEMM_ENV, PackedWeight, float32_gemm,
                                                   mkl_packed_rows_agree, mkl_packing_available,
                                                   measured_float32_gemm, onednn_packing_available)

ROW_COUNTS = [0, 1, 2, 7, 16, 33, 64, 65, 130, 512]


@pytest.fixture
def float32_gemm_set(monkeypatch):
    """Sets LLMSERVE_CPU_FP32_GEMM for one test (the choice is cached per process)."""
    def choose(kind: str) -> None:
        monkeypatch.setenv(FLOAT32_GEMM_ENV, kind)
        float32_gemm.cache_clear()
    yield choose
    monkeypatch.delenv(FLOAT32_GEMM_ENV, raising=False)
    float32_gemm.cache_clear()


AVAILABLE_FLOAT32_GEMMS = [k for k, ok in (("mkl", mkl_packing_available()), ("onednn", onednn_packing_available()))
                           if ok]


@pytest.mark.parametrize("kind", AVAILABLE_FLOAT32_GEMMS)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("shape", [(96, 40), (1000, 64), (24, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_float32_matches_dense(kind, rows, shape, with_bias, float32_gemm_set):
    float32_gemm_set(kind)
    gen = torch.Generator().manual_seed(rows * 7 + shape[0])
    w = torch.randn(*shape, generator=gen)
    b = torch.randn(shape[0], generator=gen) if with_bias else None
    x = torch.randn(rows, shape[1], generator=gen)
    packed = PackedWeight.pack(w)
    assert packed is not None and packed.kind == kind
    want = (x.double() @ w.double().t() + (b.double() if b is not None else 0)).float()
    got = packed.matmul(x, b)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not mkl_packing_available(), reason="this torch has no MKL packed sgemm")
def test_mkl_row_count_reuse_is_checked_per_shape():
    assert mkl_packed_rows_agree(576, 960 // 2)
    info = mkl_packed_rows_agree.cache_info()
    mkl_packed_rows_agree(576, 960 // 2)
    assert mkl_packed_rows_agree.cache_info().hits == info.hits + 1


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch has no oneDNN weight reorder")
@pytest.mark.parametrize("rows", [1, 5, 64, 200])
def test_onednn_packed_bfloat16_matches_dense(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 48, generator=gen).bfloat16()
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    packed = PackedWeight.pack(w)
    assert packed is not None and packed.kind == "onednn"
    want = x.float() @ w.float().t()
    torch.testing.assert_close(packed.matmul(x).float(), want, rtol=2e-2, atol=5e-2)


def test_other_dtypes_stay_dense():
    assert PackedWeight.pack(torch.randn(8, 4).half()) is None
    assert PackedWeight.pack(torch.randn(8, 4).double()) is None


def test_linear_layer_releases_dense_weight_and_keeps_results():
    layer = ReplicatedLinear(40, 24, bias=True)
    gen = torch.Generator().manual_seed(3)
    dense_w, dense_b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    layer.weight.data.copy_(dense_w)
    layer.bias.data.copy_(dense_b)
    layer.process_weights_after_loading()
    x = torch.randn(9, 40, generator=gen)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, dense_w, dense_b), rtol=1e-5, atol=1e-4)
    if layer.packed is not None:
        assert layer.weight.numel() == 0  # held once, packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lm_head_holds_one_copy_unless_tied(dtype):
    """An untied head keeps only its multiply-ready copy; a tied head leaves the embedding's
    weight in place (the embedding still looks rows up in it)."""
    from llmserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 48, generator=gen).to(dtype)
    hidden = torch.randn(5, 48, generator=gen).to(dtype)
    want = (hidden.double() @ w.double().t()).float()

    untied = ParallelLMHead(300, 48)
    untied.weight.data = w.clone()
    untied.process_weights_after_loading()
    assert untied.weight.numel() == 0
    torch.testing.assert_close(untied(hidden).float(), want, rtol=2e-2, atol=2e-2 * 48**0.5)

    embed = VocabParallelEmbedding(300, 48)
    embed.weight.data = w.clone()
    tied = ParallelLMHead(300, 48, tied_to=embed)
    tied.process_weights_after_loading()
    tied.process_weights_after_loading()  # a second call keeps the first copy
    assert embed.weight.shape == (300, 48) and torch.equal(embed(torch.tensor([7])), w[7:8])
    torch.testing.assert_close(tied(hidden).float(), want, rtol=2e-2, atol=2e-2 * 48**0.5)


def test_float32_layout_follows_the_measurement_unless_overridden(float32_gemm_set):
    float32_gemm_set("auto")
    assert float32_gemm() == measured_float32_gemm()
    float32_gemm_set("dense")
    assert float32_gemm() == "dense" and PackedWeight.pack(torch.randn(8, 4)) is None
    float32_gemm_set("cublas")
    with pytest.raises(ValueError, match="LLMSERVE_CPU_FP32_GEMM"):
        float32_gemm()
