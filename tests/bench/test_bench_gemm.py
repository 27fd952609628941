"""`llmserve bench gemm`: each product the CPU offers is timed at each row count, computes
x @ W.T, and is credited with the weight bytes it streams."""

from __future__ import annotations

import pytest
import torch

from llmserve.bench.decode_gemm import measure, products
from llmserve.kernels import cpu as cpu_kernels


def expected_products() -> set[str]:
    names = {"bfloat16 oneDNN"} if torch.backends.mkldnn.is_available() else set()
    if cpu_kernels.bf16_tiles_supported():
        names.add("bfloat16 tiles")
        if cpu_kernels.amx_supported():  # (every shape here has a depth that is a multiple of 32)
            names.add("bfloat16 AMX")
    if cpu_kernels.w8a8_supported():
        names.add("int8 W8A8")
        if cpu_kernels.amx_supported():
            names.add("int8 W8A8 AMX")
    if cpu_kernels.f32_tiles_supported():
        names.add("float32 tiles")
    if torch.backends.mkl.is_available():
        names.add("float32 MKL")
    if torch.backends.mkldnn.is_available():
        names.add("float32 oneDNN")
    return names


def weight_bytes(name: str, out_features: int, in_features: int) -> int:
    if name.startswith("int8"):
        return out_features * in_features + 4 * out_features
    return (4 if name.startswith("float32") else 2) * out_features * in_features


def test_each_product_computes_x_times_w_transposed():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen) / 128**0.5  # [out, in]
    x = torch.randn(5, 128, generator=gen)  # [rows, in]
    made = products(w)
    assert set(made) == expected_products()
    for name, (make, nbytes, dtype) in made.items():
        calls = make(2)
        assert len(calls) == 2 and nbytes == weight_bytes(name, 64, 128)
        assert dtype == (torch.float32 if name.startswith("float32") else torch.bfloat16)
        want = x.to(dtype).float() @ w.t()
        for call in calls:  # bf16 rounding of W and y; int8: W and x quantized too
            tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.08, rtol=0.05)
            torch.testing.assert_close(call(x.to(dtype)).float(), want, **tolerance)


def test_the_table_has_every_product_at_every_row_count():
    table = measure({"135M o": (576, 576)}, (1, 5), passes=1)
    assert {(r["product"], r["rows"]) for r in table} == {(p, m) for p in expected_products() for m in (1, 5)}
    for r in table:
        nbytes = weight_bytes(r["product"], 576, 576)
        assert r["weight_bytes_per_s"] == pytest.approx(nbytes / (r["us"] / 1e6))
        assert r["gflop_per_s"] == pytest.approx(2 * r["rows"] * 576 * 576 / (r["us"] / 1e6) / 1e9)


def test_only_one_products_copies_are_held_at_a_time(monkeypatch):
    # Each product's copies together exceed 4x the last-level cache: all products' at once
    # outgrew a 24 GiB host's memory where that cache is 300 MiB.
    import llmserve.bench.decode_gemm as decode_gemm

    monkeypatch.setattr(decode_gemm, "last_level_cache_bytes", lambda: 2**20)  # cold_bytes: 4 MiB
    made, live, most = products(torch.randn(64, 128)), [0], [0]

    def counted(make):
        def counting(n):
            calls = make(n)
            live[0] += 1
            most[0] = max(most[0], live[0])
            return [_Released(c, live) for c in calls][:1] * n
        return counting

    monkeypatch.setattr(decode_gemm, "products", lambda w: {k: (counted(m), b, d) for k, (m, b, d) in made.items()})
    table = measure({"o": (64, 128)}, (1,), passes=1)
    assert len(table) == len(made) and most[0] == 1


class _Released:
    """A call that counts its product as released when the bench drops it."""

    def __init__(self, call, live):
        self.call, self.live = call, live

    def __call__(self, x):
        return self.call(x)

    def __del__(self):
        self.live[0] -= 1
