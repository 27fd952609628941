"""Packed CPU weights multiply like the dense weight at every row count, with and
without bias, for every layout (float32: MKL or oneDNN; bfloat16: oneDNN or our tiles),
each chosen by a timing per machine."""

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.linear import ReplicatedLinear
from llmserve.worker.layers.packed_weight import (BFLOAT16_GEMM_ENV, FLOAT32_GEMM_ENV, PackedWeight, bfloat16_gemm,
                                                   float32_gemm, mkl_packed_rows_agree, mkl_packing_available,
                                                   measured_float32_gemm, onednn_packing_available, tiles_available)

ROW_COUNTS = [0, 1, 2, 7, 16, 33, 64, 65, 130, 512]


def layout_setter(monkeypatch, env: str, choice):
    """Sets `env` for one test, clearing the per-process cache of `choice`."""
    def choose(kind: str) -> None:
        monkeypatch.setenv(env, kind)
        choice.cache_clear()
    yield choose
    monkeypatch.delenv(env, raising=False)
    choice.cache_clear()


@pytest.fixture
def float32_gemm_set(monkeypatch):
    """Sets LLMSERVE_CPU_FP32_GEMM for one test (the choice is cached per process)."""
    yield from layout_setter(monkeypatch, FLOAT32_GEMM_ENV, float32_gemm)


AVAILABLE_FLOAT32_GEMMS = [k for k, ok in (("tiles", tiles_available(torch.float32)), ("mkl", mkl_packing_available()),
                                          ("onednn", onednn_packing_available())) if ok]


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
    # A shape our tiles cannot take (1,000 outputs: not a multiple of 16) takes a library's.
    fits = kind != "tiles" or shape[0] % 16 == 0
    assert packed is not None and packed.kind == (kind if fits else "mkl" if mkl_packing_available() else "onednn")
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


@pytest.fixture
def bfloat16_gemm_set(monkeypatch):
    """Sets LLMSERVE_CPU_BF16_GEMM for one test (the choice is cached per process)."""
    yield from layout_setter(monkeypatch, BFLOAT16_GEMM_ENV, bfloat16_gemm)


AVAILABLE_BFLOAT16_GEMMS = [k for k, ok in (("tiles", tiles_available()), ("onednn", onednn_packing_available()))
                            if ok]


@pytest.mark.parametrize("kind", AVAILABLE_BFLOAT16_GEMMS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 12, 14, 16, 33, 64, 200])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("in_features", [48, 64])
def test_packed_bfloat16_matches_dense(kind, rows, with_bias, in_features, bfloat16_gemm_set):
    bfloat16_gemm_set(kind)
    # 80 output channels: one full 48-channel tile of ours, then 2 blocks of 16 on their own;
    # rows in tiles of 8 and every remainder (1-7) after them. Depth 64 takes AMX where the
    # CPU has it, 48 (not a multiple of 32) AVX-512 BF16.
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(80, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16() if with_bias else None
    packed = PackedWeight.pack(w)
    assert packed is not None and packed.kind == kind
    want = x.float() @ w.float().t() + (0 if b is None else b.float())
    got = packed.matmul(x, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
    if kind == "tiles" and rows > 1:  # a row's product does not depend on its neighbours
        assert torch.equal(got[-1:], packed.matmul(x[-1:], b))


@pytest.mark.skipif(not tiles_available(), reason="our bfloat16 kernel needs AVX-512 BF16")
def test_shapes_our_bfloat16_kernel_cannot_take_keep_onednn(bfloat16_gemm_set):
    bfloat16_gemm_set("tiles")
    assert PackedWeight.pack(torch.randn(80, 48).bfloat16()).kind == "tiles"
    assert PackedWeight.pack(torch.randn(300, 48).bfloat16()).kind == "onednn"  # 300 rows: no 16-channel blocks
    assert PackedWeight.pack(torch.randn(80, 47).bfloat16()).kind == "onednn"  # odd depth: no bf16 pairs


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


def test_bfloat16_layout_follows_the_measurement_unless_overridden(bfloat16_gemm_set, tmp_path, monkeypatch):
    from llmserve.worker.layers import packed_weight

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(packed_weight, "_time_bfloat16_gemms", lambda: {"tiles": 2.0, "onednn": 1.0})
    bfloat16_gemm_set("auto")
    assert bfloat16_gemm() == "onednn"  # the faster one, measured once and remembered
    monkeypatch.setattr(packed_weight, "_time_bfloat16_gemms", lambda: {"tiles": 1.0, "onednn": 2.0})
    bfloat16_gemm.cache_clear()
    assert bfloat16_gemm() == "onednn"  # a later, noisier timing cannot flip it
    bfloat16_gemm_set("dense")
    assert bfloat16_gemm() == "dense" and PackedWeight.pack(torch.randn(16, 4).bfloat16()) is None
    bfloat16_gemm_set("amx")
    with pytest.raises(ValueError, match="LLMSERVE_CPU_BF16_GEMM"):
        bfloat16_gemm()


def test_layout_timings_read_weights_from_memory(monkeypatch):
    from llmserve.worker.layers import packed_weight

    monkeypatch.setattr(packed_weight, "last_level_cache_bytes", lambda: 300 * 2**20)
    assert packed_weight.cold_copies(72 * 2**20) == 7  # 504 MiB >= 1.5 x 300 MiB
    assert packed_weight.cold_copies(2**30) == 1
    assert packed_weight.cold_copies(200 * 2**20) == 3
    monkeypatch.setattr(packed_weight, "last_level_cache_bytes", lambda: 4 * 2**30)
    assert packed_weight.cold_copies(200 * 2**20) == 5  # held within 1 GiB


def test_timed_layouts_take_turns():
    from llmserve.worker.layers import packed_weight

    order = []
    rounds = {"a": [lambda: order.append("a")], "b": [lambda: order.append("b"), lambda: order.append("b")]}
    best = packed_weight.alternated_best_seconds(rounds, repeats=3, passes=1)
    assert order == ["a", "b", "b"] * 3 and set(best) == {"a", "b"} and all(s >= 0 for s in best.values())
    order.clear()
    packed_weight.alternated_best_seconds(rounds, repeats=2, passes=2)
    assert order == (["a"] * 2 + ["b"] * 4) * 2  # a round is `passes` passes over one name's products


def test_bfloat16_timing_runs_every_layout_here():
    from llmserve.worker.layers import packed_weight

    times = packed_weight._time_bfloat16_gemms()
    assert set(times) == set(AVAILABLE_BFLOAT16_GEMMS) and all(t > 0 for t in times.values())


def test_float32_layout_follows_the_measurement_unless_overridden(float32_gemm_set):
    float32_gemm_set("auto")
    assert float32_gemm() == measured_float32_gemm()
    float32_gemm_set("dense")
    assert float32_gemm() == "dense" and PackedWeight.pack(torch.randn(8, 4)) is None
    float32_gemm_set("cublas")
    with pytest.raises(ValueError, match="LLMSERVE_CPU_FP32_GEMM"):
        float32_gemm()


def _gated_mlp(gen: torch.Generator, fuse: bool, monkeypatch) -> torch.nn.Module:
    """A bfloat16 SiLU-gated MLP (hidden 128, intermediate 256) loaded from `gen`'s weights;
    `fuse` False keeps the plain gate/up blocks."""
    from types import SimpleNamespace

    from llmserve.worker.distributed import SINGLE
    from llmserve.worker.models.decoder import GatedMLP

    config = SimpleNamespace(hidden_size=128, intermediate_size=256, hidden_act="silu")
    mlp = GatedMLP(config, SINGLE).to(torch.bfloat16)
    mlp.gate_up_proj.weight.data.copy_(torch.randn(512, 128, generator=gen) / 8)
    mlp.down_proj.weight.data.copy_(torch.randn(128, 256, generator=gen) / 16)
    with monkeypatch.context() as patch:
        if not fuse:
            patch.setattr(PackedWeight, "silu_mul_fits", lambda self: False)
        for module in mlp.modules():  # (as the loader walks them: the MLP before its projections)
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()
    return mlp


@pytest.mark.skipif(not (tiles_available() and cpu_kernels.amx_supported()), reason="needs AMX-BF16")
def test_a_gated_mlp_on_amx_applies_silu_in_its_gate_up_product_with_the_same_bits(bfloat16_gemm_set, monkeypatch):
    bfloat16_gemm_set("tiles")
    fused = _gated_mlp(torch.Generator().manual_seed(5), True, monkeypatch)
    plain = _gated_mlp(torch.Generator().manual_seed(5), False, monkeypatch)
    assert fused.gate_up_proj.packed.gate_up_interleaved and not plain.gate_up_proj.packed.gate_up_interleaved
    assert fused.gate_up_proj.weight.numel() == 0  # still held once: the reordered packing is the weight
    gen = torch.Generator().manual_seed(6)
    for rows in (1, 17, 64):
        x = torch.randn(rows, 128, generator=gen).bfloat16()
        assert torch.equal(fused(x), plain(x)), rows
        # The projection alone still returns [gate | up], as every other caller expects.
        assert torch.equal(fused.gate_up_proj(x), plain.gate_up_proj(x)), rows
