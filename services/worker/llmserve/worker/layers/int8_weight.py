"""Weight-only int8: symmetric, per-output-channel weights for the linear projections.

A float weight W [out, in] becomes
    q     [out, in]  int8, in [-127, 127]
    scale [out]      float32, max |W[row]| / 127
so that W ≈ q * scale[:, None]. Activations stay in the model dtype; only the weights
are int8 (half the bytes of bfloat16, a quarter of float32).

The product y = x @ (q * scale[:, None]).T runs, per call:
  CPU, bfloat16/float16 activations, few rows (decode):
      torch.ops.aten._weight_int8pack_mm(x, q, scale): torch's own weight-only int8
      kernel; it reads q directly and applies the scale per output column of y.
  CPU, float32 activations, or many rows (prefill), and CUDA:
      the weight dequantized to x's dtype, then F.linear. NOTE: on the CPU the aten
      kernel has no vectorized float32 path (10-30x slower than the float32 linear,
      measured in docs/benchmarks.md), and for a prefill the dequantization is amortized
      over its many rows. On CUDA nothing here has been measured (no GPU was available):
      the dequantized product is correct there, not fast.

`int8_linear_reference` is the plain-torch definition the tests hold both paths to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("none", "int8")
INT8_MAX = 127
# Above this many rows a product is a prefill: dequantizing the weight once costs less
# than the rows' arithmetic, and the float GEMM is faster than the int8 kernel.
MAX_KERNEL_ROWS = 32


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, in] (any float dtype) -> (q [rows, in] int8, scale [rows] float32).

    Symmetric per row: scale = max|w| / 127 (a zero row gets scale 1 and q = 0)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / INT8_MAX  # [rows]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [out, in] int8, scale [out] -> W [out, in] in `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, in float32: x [rows, in] -> y [rows, out] in x's dtype."""
    y = x.float() @ dequantize(q, scale, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8pack_kernel_applies(x: torch.Tensor) -> bool:
    """True when torch's weight-only int8 CPU kernel is the faster path for x [rows, in]."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
            and x.dim() == 2 and x.shape[0] <= MAX_KERNEL_ROWS)


class Int8Weight:
    """y = x @ W.T (+ b) for W held as int8 rows and float scales (see the module doc)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q = q.contiguous()  # [out, in] int8
        self.scale = scale  # [out] float32
        self._scale_as: dict[torch.dtype, torch.Tensor] = {}  # the kernel wants x's dtype

    def scale_in(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scale_as:
            self._scale_as[dtype] = self.scale.to(dtype)
        return self._scale_as[dtype]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        if int8pack_kernel_applies(x):
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale_in(x.dtype))
            return y if bias is None else y + bias
        return F.linear(x, dequantize(self.q, self.scale, x.dtype), bias)
