"""`llmserve bench gemm`: the CPU's decode-sized products against the memory roofline.

A decode step at 1-64 rows reads every weight once and does little arithmetic per byte,
so its products can go no faster than the memory streams their weights. For each
projection shape (SmolLM2-135M's and a 1B Llama's) and each row count this prints the
weight bytes each product streams per second, as a share of the host's measured read
bandwidth (flops.measure_memory_bandwidth: what the roofline floor of `bench
throughput` divides by), for:
  bfloat16 tiles   our AVX-512 BF16 kernel (bf16_linear.cpp); absent without AVX-512 BF16
  bfloat16 AMX     the same packed weight multiplied on AMX tiles (amx_bf16.cpp), what
                   bf16_linear takes where the CPU has AMX-BF16; absent without
  bfloat16 oneDNN  oneDNN's blocked bfloat16 weight
  int8 W8A8        our VNNI kernel (int8_linear.cpp), bfloat16 x; absent without VNNI
  int8 W8A8 AMX    the same product on AMX tiles (amx_int8.cpp; the same bits), what
                   W8A8 takes where the CPU has AMX-INT8; absent without
  float32 tiles    our AVX-512 FMA kernel (f32_linear.cpp), float32 x; absent without AVX-512
  float32 MKL      MKL's packed sgemm; absent where torch has no MKL
  float32 oneDNN   oneDNN's blocked float32 weight

NOTE: the weights are cold, as in a decode step (a whole model's weights pass through
the cache once per step): each product cycles through copies of its weight that together
exceed 4x the last-level cache, so no call finds its weight cached. A cell is the
fastest call of `--passes` passes over all copies: on a shared host the call nobody
interrupted. GFLOP/s beside it shows where a product is bound by arithmetic instead
(many rows, no AMX): there the bandwidth share cannot reach the target.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from llmserve.bench.flops import measure_memory_bandwidth
from llmserve.bench.report import host_line, machine_info, save_report
from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels.cpu.host import last_level_cache_bytes
from llmserve.worker.layers.int8_weight import Int8Weight, quantize_rows

# name -> (out, in) of y = x @ W.T: the projections of SmolLM2-135M (hidden 576) and of
# Llama-3.2-1B (hidden 2048, intermediate 8192, 32 q / 8 KV heads of 64).
SHAPES = {
    "135M qkv": (960, 576), "135M o": (576, 576), "135M gate_up": (3072, 576), "135M down": (576, 1536),
    "135M LM head": (49152, 576),
    "1B qkv": (3072, 2048), "1B o": (2048, 2048), "1B gate_up": (16384, 2048), "1B down": (2048, 8192),
}
ROWS = (1, 4, 16, 64)
TARGET_SHARE = 0.8  # issue #34: decode-sized products at >= 80% of the host's bandwidth


# (makes one x -> x @ W.T per copy of the weight, given how many; bytes one call streams;
# the dtype of the x it takes)
Product = tuple[Callable[[int], list[Callable[[torch.Tensor], torch.Tensor]]], int, torch.dtype]


def products(w: torch.Tensor) -> dict[str, Product]:
    """name -> the product's maker, its weight bytes per call and its x's dtype.

    NOTE: makers, not the copies: each product's copies are made, timed and dropped in
    turn. Made all at once they held ~4x the last-level cache per product (on a Xeon
    with 300 MiB of it, the LM head's float32 and bfloat16 layouts together: over 11
    GB), and the bench was killed for memory on a 24 GiB host."""
    from llmserve.worker.layers.packed_weight import (PackedWeight, mkl_packing_available, onednn_packing_available,
                                                      tiles_available, tiles_fit)

    out_features, in_features = w.shape
    made: dict[str, Product] = {}
    wb = w.bfloat16()
    if cpu_kernels.bf16_tiles_supported():
        for name, engine in (("bfloat16 tiles", "avx512"), ("bfloat16 AMX", "amx")):
            if engine == "amx" and not (cpu_kernels.amx_supported() and in_features % 32 == 0):
                continue
            made[name] = (lambda n, e=engine: [lambda x, t=cpu_kernels.bf16_pack_weight(wb): cpu_kernels.bf16_linear(
                x, t, e) for _ in range(n)], 2 * w.numel(), torch.bfloat16)
    if torch.backends.mkldnn.is_available():
        linear = torch.ops.mkldnn._linear_pointwise
        made["bfloat16 oneDNN"] = (lambda n: [lambda x, b=torch.ops.mkldnn._reorder_linear_weight(wb, 64): linear(
            x, b, None, "none", [], "") for _ in range(n)], 2 * w.numel(), torch.bfloat16)
    if cpu_kernels.w8a8_supported():
        q, scale = quantize_rows(w)
        for name, engine in (("int8 W8A8", "vnni"), ("int8 W8A8 AMX", "amx")):
            if engine == "amx" and not cpu_kernels.amx_supported():
                continue
            made[name] = (lambda n, e=engine: [
                lambda x, i=Int8Weight(q, scale, quantize_activations=True): cpu_kernels.w8a8_linear(
                    x, i.w8a8_packed, i.scale, e) for _ in range(n)], w.numel() + 4 * out_features, torch.bfloat16)
    layouts = [("tiles", tiles_available(torch.float32) and tiles_fit(out_features, in_features, torch.float32)),
               ("MKL", mkl_packing_available()), ("oneDNN", onednn_packing_available())]
    for name, available in layouts:
        if available:
            made[f"float32 {name}"] = (lambda n, k=name.lower(): [PackedWeight.packed_as(k, w.contiguous()).matmul
                                                                  for _ in range(n)], 4 * w.numel(), torch.float32)
    return made


def fastest_call_seconds(calls: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, passes: int) -> float:
    """Seconds of the fastest call in `passes` passes over `calls` (one call per weight
    copy, so every call streams a weight the cache has dropped)."""
    for call in calls[: max(1, len(calls) // 4)]:  # warm-up: first-call setup, the allocator
        call(x)
    best = float("inf")
    for _ in range(passes):
        for call in calls:
            start = time.perf_counter()
            call(x)
            best = min(best, time.perf_counter() - start)
    return best


def measure(shapes: dict[str, tuple[int, int]], rows: tuple[int, ...], passes: int) -> list[dict]:
    """One row per (shape, rows, product): seconds per call and weight bytes per second."""
    cold_bytes = 4 * last_level_cache_bytes()
    gen = torch.Generator().manual_seed(0)
    table = []
    for name, (out_features, in_features) in shapes.items():
        w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5  # [out, in]
        xs = {m: torch.randn(m, in_features, generator=gen) for m in rows}  # [m, in]
        for product, (make, nbytes, dtype) in products(w).items():
            calls = make(max(2, -(-cold_bytes // nbytes)))  # together over cold_bytes: none cached
            for m, x in xs.items():
                seconds = fastest_call_seconds(calls, x.to(dtype), passes)
                table.append({"shape": name, "out": out_features, "in": in_features, "rows": m, "product": product,
                              "us": 1e6 * seconds, "weight_bytes_per_s": nbytes / seconds,
                              "gflop_per_s": 2 * m * w.numel() / seconds / 1e9})
            del calls
    return table


def print_table(table: list[dict], bandwidth: float) -> None:
    names = list(dict.fromkeys(r["product"] for r in table))
    heads = "  ".join(f"{n + ' us  GB/s  share GFLOP/s':>40}" for n in names)
    print(f"{'shape':>14} {'out x in':>12} {'rows':>4}  {heads}")
    cells: dict[tuple, dict[str, dict]] = {}
    for r in table:
        cells.setdefault((r["shape"], r["out"], r["in"], r["rows"]), {})[r["product"]] = r
    for (shape, n, k, m), by_product in cells.items():
        line = f"{shape:>14} {f'{n}x{k}':>12} {m:>4}  "
        for name in names:
            r = by_product.get(name)
            if r is None:
                line += f"{'-':>40}  "
                continue
            share = r["weight_bytes_per_s"] / bandwidth
            flag = " " if share >= TARGET_SHARE else "<"
            line += (f"{r['us']:>14.1f} {r['weight_bytes_per_s'] / 1e9:>6.1f} {100 * share:>6.0f}%{flag}"
                     f" {r['gflop_per_s']:>7.0f}   ")
        print(line.rstrip(), flush=True)


def bench_gemm(args) -> int:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    bandwidth = measure_memory_bandwidth()
    machine = machine_info()
    print(f"{host_line(machine)}; torch {torch.__version__}, {torch.get_num_threads()} threads; measured read "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s; last-level cache {last_level_cache_bytes() / 2**20:.0f} MiB "
          f"(weights cycled through 4x that); '<': under {100 * TARGET_SHARE:.0f}% of the bandwidth", flush=True)
    shapes = {k: v for k, v in SHAPES.items() if not args.shapes or any(s in k for s in args.shapes)}
    table = measure(shapes, tuple(args.rows), args.passes)
    print_table(table, bandwidth)
    save_report({"kind": "gemm", "machine": machine, "read_bandwidth": bandwidth, "table": table}, args.output_dir,
                f"gemm-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return 0


def add_gemm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="activation rows (decode batch sizes)")
    p.add_argument("--shapes", nargs="*", default=[], help="only shapes whose name contains one of these ('135M', "
                                                           "'1B', 'gate_up', ...)")
    p.add_argument("--passes", type=int, default=5, help="passes over the weight copies; the fastest is kept")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--output-dir", default="", help="write the table as JSON here too")
