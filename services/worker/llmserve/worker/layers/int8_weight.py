"""int8 linear projections: symmetric per-output-channel int8 weights, and on CPUs with
AVX-512 VNNI dynamically quantized int8 activations (W8A8).

A float weight W [out, in] becomes
    q     [out, in]  int8, in [-127, 127]
    scale [out]      float32, max |W[row]| / 127
so that W ~= q * scale[:, None] (half the bytes of bfloat16, a quarter of float32).

`--quantization int8` computes y = x @ W.T, per call:
  W8A8, on a CPU whose kernels were built with AVX-512 VNNI (out % 16 == 0, in % 64 == 0):
      x is quantized per row and per group of ACTIVATION_GROUP columns (symmetric, one
      float scale each) and the int8 x int8 products sum in int32 (llmserve_cpu's
      w8a8_linear, int8_linear.cpp). Prefill and decode both run it: measured 1.4-5x
      faster than oneDNN's bfloat16 GEMM at 1 to 1024 rows (docs/benchmarks.md). Groups, not
      one scale per row: SmolLM2-135M's perplexity moves +1.0% with groups of 64 and
      +3.6% with a scale per row.
  weight-only, everywhere else and with `--quantization int8-weight-only`:
      CPU, bfloat16/float16 activations, few rows (decode):
          torch.ops.aten._weight_int8pack_mm(x, q, scale), torch's own kernel.
      CPU, float32 activations, or many rows (prefill), and CUDA:
          the weight dequantized to x's dtype, then F.linear. NOTE: on the CPU the aten
          kernel has no vectorized float32 path (10-30x slower than the float32 linear,
          measured in docs/benchmarks.md), and for a prefill the dequantization is
          amortized over its many rows. On CUDA nothing here has been measured (no GPU
          was available): the dequantized product is correct there, not fast.

`int8_linear_reference` and `w8a8_linear_reference` are the plain-torch definitions the
tests hold both paths to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker import huge_pages

QUANTIZATIONS = ("none", "int8", "int8-weight-only")
INT8_MAX = 127
ACTIVATION_GROUP = 64  # activation columns sharing one scale under W8A8 (int8_linear.cpp's kGroup)
W8A8_BLOCK = 16  # output channels per packed block (int8_linear.cpp's kBlockN)
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


def is_int8(quantization: str) -> bool:
    """True for the quantizations whose projection weights are held in int8."""
    return quantization in ("int8", "int8-weight-only")


def w8a8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 definition in float32: x [rows, in] quantized per row and group of
    ACTIVATION_GROUP columns (scale = max|group| / 127, round half to even), times the
    int8 weight -> y [rows, out] in x's dtype."""
    rows, width = x.shape
    groups = x.float().reshape(rows, width // ACTIVATION_GROUP, ACTIVATION_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)  # [rows, groups, 1]
    inverse = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inverse).clamp_(-INT8_MAX, INT8_MAX)
    x_dequantized = (xq * (amax / INT8_MAX)).reshape(rows, width)
    return int8_linear_reference(x_dequantized, q, scale, bias).to(x.dtype)


def w8a8_applies(w: torch.Tensor, quantization: str) -> bool:
    """True when the W8A8 kernel runs this weight w [out, in] (float or already int8; see
    the module doc)."""
    if quantization != "int8" or w.device.type != "cpu":
        return False
    if w.shape[0] % W8A8_BLOCK or w.shape[1] % ACTIVATION_GROUP:
        return False
    return cpu_kernels.w8a8_supported()


def int8pack_kernel_applies(x: torch.Tensor) -> bool:
    """True when torch's weight-only int8 CPU kernel is the faster path for x [rows, in]."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
            and x.dim() == 2 and x.shape[0] <= MAX_KERNEL_ROWS)


class Int8Weight:
    """y = x @ W.T (+ b) for W held as int8 rows and float scales (see the module doc).

    With `quantize_activations` (W8A8) the weight is kept only in the kernel's packed
    layout [out/16, in/4, 16, 4]; `q` is then None."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, quantize_activations: bool = False):
        self.scale = scale.float().contiguous()  # [out] float32
        self.w8a8_packed: torch.Tensor | None = None
        self.q: torch.Tensor | None = None
        if quantize_activations:
            if not cpu_kernels.w8a8_supported():  # (also builds and loads the kernels)
                raise ValueError("int8 W8A8 needs the CPU kernels built with AVX-512 VNNI")
            self.w8a8_packed = huge_pages.moved(cpu_kernels.w8a8_pack_weight(q))
        else:
            self.q = q.contiguous()  # [out, in] int8
        self._scale_as: dict[torch.dtype, torch.Tensor] = {}  # the aten kernel wants x's dtype

    @property
    def quantizes_activations(self) -> bool:
        return self.w8a8_packed is not None

    def int8_rows(self) -> torch.Tensor:
        """q [out, in] int8, unpacked from the W8A8 layout when that is how it is held."""
        if self.q is not None:
            return self.q
        packed = self.w8a8_packed  # [out/16, in/4, 16, 4] uint8 holding q + 128
        rows = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * W8A8_BLOCK, packed.shape[1] * 4)
        return (rows.to(torch.int16) - 128).to(torch.int8)

    def scale_in(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._scale_as:
            self._scale_as[dtype] = self.scale.to(dtype)
        return self._scale_as[dtype]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        if self.w8a8_packed is not None and x.dtype in (torch.float32, torch.bfloat16):
            y = cpu_kernels.w8a8_linear(x, self.w8a8_packed, self.scale)
            return y if bias is None else y + bias
        if self.q is None:
            raise ValueError(f"int8 W8A8 weights take float32 or bfloat16 activations, not {x.dtype}")
        if int8pack_kernel_applies(x):
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale_in(x.dtype))
            return y if bias is None else y + bias
        return F.linear(x, dequantize(self.q, self.scale, x.dtype), bias)


def describe_quantization(model: torch.nn.Module, quantization: str) -> str:
    """For the start-up log: e.g. "int8 (W8A8 in 120 of 120 projections)"."""
    weights = [m.int8 for m in model.modules() if getattr(m, "int8", None) is not None]
    if not weights:
        return quantization
    w8a8 = sum(w.quantizes_activations for w in weights)
    return f"{quantization} (W8A8 in {w8a8} of {len(weights)} projections, weight-only in the rest)"
