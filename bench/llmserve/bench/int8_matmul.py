"""The CPU products behind `--quantization int8`'s kernel choice, one shape at a time:

  python -m llmserve.bench.int8_matmul [--threads N] [--reps R]

y = x @ W.T for x [rows, in] at decode-sized rows (1, 4, 16), W [out, in] of SmolLM2's
layer shapes (576 hidden, 1536 intermediate) and a larger model's (2048 / 8192), through:
  float32 packed   oneDNN's blocked float32 weight (what float32 runs on AMD CPUs)
  bfloat16 packed  oneDNN's blocked bfloat16 weight (what bfloat16 runs)
  int8, fp32 x     torch.ops.aten._weight_int8pack_mm with float32 activations
  int8, bf16 x     the same with bfloat16 activations (what int8 runs at decode)
  int8 dequant     W dequantized to bfloat16 per call, then F.linear (weight-only int8's
                   prefill path)
  int8 W8A8        our VNNI kernel, bfloat16 x quantized per 64 columns (what int8 runs
                   where the CPU has AVX-512 VNNI); nan where it does not
  bfloat16 tiles   our bfloat16 kernel (what bfloat16 runs where it times faster than
                   oneDNN's: on AMX tiles where the CPU has AMX-BF16, else AVX-512 BF16);
                   nan where the CPU has neither
Each cell is the fastest of `reps` calls in microseconds: on a shared machine the fastest
call is the one nobody interrupted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.int8_weight import Int8Weight, dequantize, quantize_rows

# (out, in): qkv, o, gate_up, down, LM head of SmolLM2-135M; gate_up and down of a
# 2048/8192 model.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (16384, 2048), (2048, 8192))
ROWS = (1, 4, 16, 64)
COLUMNS = ("float32 packed", "bfloat16 packed", "int8, fp32 x", "int8, bf16 x", "int8 dequant", "int8 W8A8",
           "bfloat16 tiles")


def fastest_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e6 * best


def products(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The five ways to compute x @ w.T (see the module doc), ready to time."""
    linear = torch.ops.mkldnn._linear_pointwise
    f32 = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
    q, scale = quantize_rows(w)
    xb, scale_b = x.bfloat16(), scale.bfloat16()
    fns = {"float32 packed": lambda: linear(x, f32, None, "none", [], ""),
           "bfloat16 packed": lambda: linear(xb, bf16, None, "none", [], ""),
           "int8, fp32 x": lambda: torch.ops.aten._weight_int8pack_mm(x, q, scale),
           "int8, bf16 x": lambda: torch.ops.aten._weight_int8pack_mm(xb, q, scale_b),
           "int8 dequant": lambda: F.linear(xb, dequantize(q, scale, torch.bfloat16))}
    if cpu_kernels.w8a8_supported():
        w8a8 = Int8Weight(q, scale, quantize_activations=True)
        fns["int8 W8A8"] = lambda: w8a8.matmul(xb)
    if cpu_kernels.bf16_tiles_supported():
        tiles = cpu_kernels.bf16_pack_weight(w.bfloat16())
        fns["bfloat16 tiles"] = lambda: cpu_kernels.bf16_linear(xb, tiles)
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), fastest of {args.reps} calls, us")
    print(f"{'out x in':>13} {'rows':>4} " + " ".join(f"{c:>15}" for c in COLUMNS)
          + f" {'aten/bf16':>9} {'W8A8/bf16':>9} {'tiles/bf16':>10}")
    for out_features, in_features in SHAPES:
        w = torch.randn(out_features, in_features, generator=gen)
        for rows in ROWS:
            fns = products(w, torch.randn(rows, in_features, generator=gen))
            reps = args.reps if out_features * in_features < 5e6 else 10  # the large shapes: ms per call
            us = {name: fastest_us(fn, reps) for name, fn in fns.items()}
            nan = float("nan")
            print(f"{out_features:>6} x {in_features:<4} {rows:>4} "
                  + " ".join(f"{us.get(c, nan):>15.1f}" for c in COLUMNS)
                  + f" {us['bfloat16 packed'] / us['int8, bf16 x']:>8.2f}x"
                  + f" {us['bfloat16 packed'] / us.get('int8 W8A8', nan):>8.2f}x"
                  + f" {us['bfloat16 packed'] / us.get('bfloat16 tiles', nan):>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
