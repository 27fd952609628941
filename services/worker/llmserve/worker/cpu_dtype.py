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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.worker.layers import packed_weight

BF16_INSTRUCTION_SETS = ("amx_bf16", "avx512_bf16")
BF16_MIN_SPEEDUP = 1.15  # Below this, bfloat16's rounding buys too little.


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _time_bf16_vs_float32() -> dict:
    """Seconds per round of decode-shaped products in float32 (this machine's layout) and
    in bfloat16 (oneDNN packed), and the ratio."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        products = []
        for x, w in packed_weight.timed_cases(dtype):
            packed = packed_weight.PackedWeight.pack(w)
            products.append(functools.partial(packed.matmul, x) if packed is not None
                            else functools.partial(torch.nn.functional.linear, x, w))
        times[str(dtype).removeprefix("torch.")] = packed_weight.best_round_seconds(products)
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
