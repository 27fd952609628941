"""`--dtype auto` on the CPU: the checkpoint's own bfloat16 where this CPU multiplies
bfloat16 fast, float32 otherwise, and why.

Two facts decide, neither of them the vendor's name:
- the instruction sets the CPU reports: AMX (amx_bf16) or AVX-512 BF16 (avx512_bf16)
  multiply bfloat16 natively; without them oneDNN emulates it, slower than float32;
- a measurement: decode-shaped products in bfloat16 (oneDNN's packed layout, what the
  worker uses) against float32 (the layout this machine chose), timed once per machine
  and remembered (packed_weight.remembered), so every process of a host agrees.

A float32 checkpoint stays float32 (nothing to gain from rounding its weights), and so
does a bfloat16 one on a CPU where bfloat16 is not at least BF16_MIN_SPEEDUP faster.

A checkpoint stored quantized (a GGUF's Q4_1, Q8_0, Q4_K, ...) has no float precision of
its own to keep: it takes whichever of int8 weights with int8 activations (W8A8, where
the CPU kernels were built with AVX-512 VNNI), bfloat16 and float32 this CPU measures
fastest, int8 only when at least INT8_MIN_SPEEDUP faster than the best float.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from llmserve.kernels.cpu.host import cpu_facts
from llmserve.worker.layers import packed_weight

BF16_INSTRUCTION_SETS = ("amx_bf16", "avx512_bf16")
BF16_MIN_SPEEDUP = 1.15  # Below this, bfloat16's rounding buys too little.
# Below this, quantizing activations (SmolLM2-135M's perplexity +1.0%, int8_weight.py) buys too little.
INT8_MIN_SPEEDUP = 1.15
W8A8_ROUNDS = 21  # W8A8 and float rounds timed in turn, this many each


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    quantization: str | None = None  # What `auto` chose for a quantized checkpoint; None keeps --quantization.


def cpu_flags() -> frozenset[str]:
    return cpu_facts().flags


def _time_bf16_vs_float32() -> dict:
    """Seconds per round of decode-shaped products in float32 and in bfloat16 (each in this
    machine's packed layout), the two taking turns, and the ratio."""
    rounds = {}
    for dtype in (torch.float32, torch.bfloat16):
        products = []
        for x, w in packed_weight.timed_cases(dtype):
            packed = packed_weight.PackedWeight.pack(w)
            products.append(functools.partial(packed.matmul, x) if packed is not None
                            else functools.partial(torch.nn.functional.linear, x, w))
        rounds[str(dtype).removeprefix("torch.")] = products
    times = packed_weight.alternated_best_seconds(rounds)
    return {"seconds": times, "speedup": times["float32"] / times["bfloat16"]}


def bf16_speedup() -> float:
    """How much faster bfloat16 products run than float32 ones on this machine."""
    return packed_weight.remembered("bf16-vs-float32", _time_bf16_vs_float32)["speedup"]


def choose_cpu_dtype(checkpoint_dtype: torch.dtype) -> DtypeChoice:
    """`--dtype auto` on the CPU for a checkpoint stored in `checkpoint_dtype`."""
    if checkpoint_dtype != torch.bfloat16:
        return DtypeChoice(torch.float32, f"the checkpoint is {str(checkpoint_dtype).removeprefix('torch.')}: "
                                          f"float32 on the CPU")
    sets = [s for s in BF16_INSTRUCTION_SETS if s in cpu_flags()]
    if not sets:
        return DtypeChoice(torch.float32, "bfloat16 checkpoint, but this CPU has neither AMX nor AVX-512 BF16 "
                                          "(bfloat16 would be emulated, slower than float32): float32")
    speedup = bf16_speedup()
    if speedup < BF16_MIN_SPEEDUP:
        return DtypeChoice(torch.float32, f"bfloat16 checkpoint and {'/'.join(sets)}, but bfloat16 products "
                                          f"measured only {speedup:.2f}x float32 here: float32")
    return DtypeChoice(torch.bfloat16, f"bfloat16 checkpoint, this CPU has {'/'.join(sets)}, and bfloat16 "
                                       f"products measured {speedup:.2f}x float32 here")


def _time_w8a8_vs(dtype: torch.dtype) -> dict:
    """Seconds per round of the decode-shaped products with `dtype` activations: W8A8
    (int8_linear.cpp) against `dtype` weights in their packed layout, and the ratio."""
    from llmserve.kernels import cpu as cpu_kernels
    from llmserve.worker.layers.int8_weight import quantize_rows

    floats, int8s = [], []
    for x, w in packed_weight.timed_cases(dtype):
        packed = packed_weight.PackedWeight.pack(w)
        floats.append(functools.partial(packed.matmul, x) if packed is not None
                      else functools.partial(torch.nn.functional.linear, x, w))
        q, scale = quantize_rows(w)  # q: [out, in] int8; scale: [out]
        int8s.append(functools.partial(cpu_kernels.w8a8_linear, x, cpu_kernels.w8a8_pack_weight(q), scale))
    name = str(dtype).removeprefix("torch.")
    times = packed_weight.alternated_best_seconds({"w8a8": int8s, name: floats}, repeats=W8A8_ROUNDS)
    return {"seconds": times, "speedup": times[name] / times["w8a8"]}


def w8a8_speedup(dtype: torch.dtype) -> float:
    """How much faster W8A8 products run than `dtype` ones on this machine (0 where the
    W8A8 kernel was not built)."""
    from llmserve.kernels import cpu as cpu_kernels

    if not cpu_kernels.w8a8_supported():
        return 0.0
    name = str(dtype).removeprefix("torch.")
    return packed_weight.remembered(f"w8a8-vs-{name}", lambda: _time_w8a8_vs(dtype))["speedup"]


def _fastest_float() -> tuple[torch.dtype, str]:
    """bfloat16 where this CPU multiplies it at least BF16_MIN_SPEEDUP faster than float32,
    else float32; and the grounds."""
    sets = [s for s in BF16_INSTRUCTION_SETS if s in cpu_flags()]
    if not sets:
        return torch.float32, "float32 (this CPU has neither AMX nor AVX-512 BF16)"
    speedup = bf16_speedup()
    if speedup < BF16_MIN_SPEEDUP:
        return torch.float32, f"float32 (bfloat16 products measured only {speedup:.2f}x float32 here)"
    return torch.bfloat16, f"bfloat16 ({'/'.join(sets)}; its products measured {speedup:.2f}x float32 here)"


def choose_cpu_for_quantized(weight_type: str) -> DtypeChoice:
    """`--dtype auto` on the CPU for a checkpoint stored quantized as `weight_type`
    (a GGUF's Q4_1, Q8_0, ...): int8 W8A8 where it measures fastest, else the faster float."""
    dtype, grounds = _fastest_float()
    speedup = w8a8_speedup(dtype)
    name = str(dtype).removeprefix("torch.")
    if speedup >= INT8_MIN_SPEEDUP:
        return DtypeChoice(dtype, f"{weight_type} checkpoint: int8 weights and activations (W8A8 products measured "
                                  f"{speedup:.2f}x {name} here), {grounds} elsewhere", quantization="int8")
    why = ("the CPU kernels have no W8A8 (no AVX-512 VNNI)" if speedup == 0
           else f"W8A8 products measured only {speedup:.2f}x {name} here")
    return DtypeChoice(dtype, f"{weight_type} checkpoint, dequantized to {grounds}; not int8: {why}")
