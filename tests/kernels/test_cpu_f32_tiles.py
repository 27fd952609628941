"""Our float32 products (csrc/f32_linear.cpp: the bfloat16 kernel's register tiles with
FMAs over a [N/16, K, 16] layout) against a float64 reference, each row's result
independent of the rows beside it, and the shapes it refuses named."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.f32_tiles_supported(), reason="float32 tiles need AVX-512 F")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64])
# 2,000: a partial last tile of 3 blocks; depth 2,103: above 8 rows, three slices of the depth, the last partial
# and not a whole number of the k loop's groups of 4 (nor is 43; 1 is none)
@pytest.mark.parametrize("shape", [(96, 40), (48, 43), (2000, 576), (16, 1), (64, 2103)])
def test_float32_products_match_float64(rows, shape):
    gen = torch.Generator().manual_seed(rows * 31 + shape[0])
    w = torch.randn(*shape, generator=gen)
    x = torch.randn(rows, shape[1], generator=gen)
    packed = cpu_kernels.f32_pack_weight(w)
    last = shape[0] // 16 - 1  # packed[b, k, j] = w[16 b + j, k]
    assert packed.shape == (shape[0] // 16, shape[1], 16) and torch.equal(packed[last, :, 3], w[16 * last + 3])
    got = cpu_kernels.f32_linear(x, packed)
    want = (x.double() @ w.double().t()).float()
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


@pytest.mark.parametrize("rows", [5, 24, 41])
@pytest.mark.parametrize("depth", [200, 2100])  # 2,100: sliced in depth above 8 rows (one pass at 1 row)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(rows, depth):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(304, depth, generator=gen)
    x = torch.randn(rows, depth, generator=gen)
    packed = cpu_kernels.f32_pack_weight(w)
    together = cpu_kernels.f32_linear(x, packed)
    for i in range(rows):  # (bit for bit: the same sums in the same order)
        assert torch.equal(together[i], cpu_kernels.f32_linear(x[i : i + 1], packed)[0]), i
    strided = cpu_kernels.f32_linear(torch.randn(depth, rows, generator=gen).t(), packed)  # made contiguous inside
    assert strided.shape == (rows, 304)


def test_what_the_kernel_cannot_take_is_refused_by_name():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.f32_pack_weight(torch.randn(20, 8))
    packed = cpu_kernels.f32_pack_weight(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        cpu_kernels.f32_linear(torch.randn(2, 9), packed)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.f32_linear(torch.randn(2, 8).bfloat16(), packed)
    assert cpu_kernels.f32_linear(torch.randn(0, 8), packed).shape == (0, 32)
