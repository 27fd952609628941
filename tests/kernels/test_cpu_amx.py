"""Products on AMX tiles (csrc/amx_bf16.cpp, amx_int8.cpp), the engine bf16_linear and
w8a8_linear take where the CPU has AMX: bfloat16 against float32 products of the same
values, row by row, and against the AVX-512 engine on the same packed weight; W8A8 int8
bit for bit against the AVX-512 VNNI engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llmserve.kernels import cpu as cpu_kernels

needs_amx = pytest.mark.skipif(not cpu_kernels.amx_supported(),
                               reason="AMX absent on this CPU (or refused by its OS)")


def _case(rows: int, out_features: int, in_features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    return x, w, cpu_kernels.bf16_pack_weight(w)


@needs_amx
# 16-row tiles and the rows around their edges; 80 channels = 2 pairs of blocks and a
# lone block, 96 = 3 pairs; depths of 1 and of 18 k steps of 32.
@pytest.mark.parametrize("rows", [1, 2, 5, 15, 16, 17, 31, 32, 33, 48, 64, 100])
@pytest.mark.parametrize("shape", [(80, 32), (96, 576), (80, 1536)])
def test_amx_products_match_float32(rows, shape):
    x, w, packed = _case(rows, *shape, seed=rows)
    got = cpu_kernels.bf16_linear(x, packed, "amx")
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    want = x.float() @ w.float().t()
    # float32 sums of exact bfloat16 products, rounded once to bfloat16: half an ulp of
    # bfloat16 (2^-9 relative) plus the sums' float32 order.
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3 * shape[1] ** 0.5)


@needs_amx
@pytest.mark.parametrize("rows", [3, 16, 40, 64])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(rows):
    # A sequence's logits must not change with the number of sequences in its step.
    x, _, packed = _case(rows, 96, 576, seed=100 + rows)
    together = cpu_kernels.bf16_linear(x, packed, "amx")
    for r in range(rows):
        assert torch.equal(cpu_kernels.bf16_linear(x[r:r + 1], packed), together[r:r + 1]), r


@needs_amx
def test_auto_takes_amx_wherever_the_depth_allows():
    x, _, packed = _case(7, 80, 64, seed=1)
    assert torch.equal(cpu_kernels.bf16_linear(x, packed), cpu_kernels.bf16_linear(x, packed, "amx"))
    x, _, packed = _case(7, 80, 48, seed=2)  # 48 is not a multiple of AMX's 32: the AVX-512 engine
    assert torch.equal(cpu_kernels.bf16_linear(x, packed), cpu_kernels.bf16_linear(x, packed, "avx512"))
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        cpu_kernels.bf16_linear(x, packed, "amx")


_REFUSAL = """
import torch
from llmserve.kernels import cpu
assert cpu.load()
gen = torch.Generator().manual_seed(0)
packed = cpu.bf16_pack_weight(torch.randn(80, 64, generator=gen).bfloat16())
x = torch.randn(7, 64, generator=gen).bfloat16()
for engine in {engines!r}:
    cpu.bf16_linear(x, packed, engine)
try:
    cpu.bf16_linear(x, packed[:, :16].contiguous(), "auto")
except RuntimeError as err:
    print("refused:", str(err).splitlines()[0])
"""


@needs_amx
@pytest.mark.parametrize("engines", [(), ("avx512",), ("amx",), ("amx", "avx512")])
def test_a_refused_input_raises_in_a_fresh_process_after_any_product(engines):
    # On an H200 host (a sandboxed Xeon with AMX, torch 2.11, 2026-11-28) the first
    # refusal in test_auto_takes_amx_wherever_the_depth_allows ended its process with
    # SIGSEGV instead of raising. Each case here is a process of its own, the refusal its
    # first C++ exception, after products on neither, either or both engines: where the
    # fault recurs, which case fails says whether AMX use is what leads to it.
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _REFUSAL.format(engines=engines)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    assert out.stdout.strip() == "refused: bf16 tiles: x has 64 features, the weight 32"


@needs_amx
def test_the_two_engines_agree_to_bfloat16_rounding():
    x, _, packed = _case(24, 96, 576, seed=3)
    amx = cpu_kernels.bf16_linear(x, packed, "amx").float()
    avx512 = cpu_kernels.bf16_linear(x, packed, "avx512").float()
    torch.testing.assert_close(amx, avx512, rtol=2**-7, atol=0.0)


@pytest.mark.skipif(not cpu_kernels.bf16_tiles_supported(), reason="our bfloat16 kernel needs AVX-512 BF16")
def test_llmserve_cpu_amx_0_keeps_the_avx512_engines():
    code = ("from llmserve.kernels import cpu; import torch; assert cpu.load(); "
            "print(cpu.amx_supported())")
    env = {**os.environ, "LLMSERVE_CPU_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@needs_amx
@pytest.mark.skipif(not cpu_kernels.w8a8_supported(), reason="W8A8 int8 needs AVX-512 VNNI")
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("shape", [(80, 64), (96, 576), (80, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_on_amx_gives_the_vnni_engines_bits(rows, shape, dtype):
    # Integer sums are exact in either engine, and the float epilogue is the same
    # operations in the same order: the engine is a speed choice, never a numerics one.
    from llmserve.worker.layers.int8_weight import quantize_rows

    gen = torch.Generator().manual_seed(rows)
    q, scale = quantize_rows(torch.randn(*shape, generator=gen))
    packed = cpu_kernels.w8a8_pack_weight(q)
    x = torch.randn(rows, shape[1], generator=gen).to(dtype)
    amx = cpu_kernels.w8a8_linear(x, packed, scale, "amx")
    assert amx.dtype == dtype and amx.shape == (rows, shape[0])
    assert torch.equal(amx, cpu_kernels.w8a8_linear(x, packed, scale, "vnni"))
    assert torch.equal(cpu_kernels.w8a8_linear(x, packed, scale), amx)  # auto: AMX


@needs_amx
# 16-row tiles and their edges; 2 x 32 channels = one gate/up pair of blocks, 2 x 96 =
# 6 pairs (3 column pairs of the product per thread's share); depths of 1 and 18 k steps.
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("d,in_features", [(32, 32), (96, 576)])
def test_silu_mul_in_the_product_gives_the_unfused_bits(rows, d, in_features):
    x, w, plain = _case(rows, 2 * d, in_features, seed=7 * rows + d)
    x = 4 * x  # gates from about -16 to 16: both of silu's tails
    interleaved = cpu_kernels.interleave_gate_up_blocks(plain)
    got = cpu_kernels.bf16_linear_silu_mul(x, interleaved)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, d)
    assert torch.equal(got, cpu_kernels.silu_and_mul(cpu_kernels.bf16_linear(x, plain, "amx")))
    # The interleaved blocks are the plain ones reordered: gate block j, then up block j.
    assert torch.equal(interleaved[0::2], plain[: d // 16]) and torch.equal(interleaved[1::2], plain[d // 16:])


@needs_amx
def test_silu_mul_in_the_product_refuses_what_it_cannot_take():
    x, _, plain = _case(4, 48, 64, seed=3)  # 3 blocks: no gate/up halves
    with pytest.raises(RuntimeError, match="even number of blocks"):
        cpu_kernels.bf16_linear_silu_mul(x, plain)
    with pytest.raises(ValueError, match="3 blocks"):
        cpu_kernels.interleave_gate_up_blocks(plain)
    x, _, plain = _case(4, 64, 48, seed=4)  # depth 48: not AMX's multiple of 32
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        cpu_kernels.bf16_linear_silu_mul(x, cpu_kernels.interleave_gate_up_blocks(plain))
