"""CPU weights reordered once, at load, into the layout of the library that multiplies
them fastest, then held only in that layout (the dense copy is released).

  float32:  on Intel CPUs, MKL's packed-GEMM format (cblas_sgemm_pack / sgemm_compute,
            through torch's `mkl::_mkl_linear`): faster than plain MKL sgemm on the few
            rows of a decode step and on the LM head (a long prefill gains nothing).
            On other CPUs, oneDNN's blocked layout: MKL takes slower kernels off Intel,
            and there oneDNN's packed products beat MKL's packed ones, decode and prefill.
            LLMSERVE_CPU_FP32_GEMM = mkl | onednn | dense overrides the choice.
  bfloat16: oneDNN's blocked layout (the reorder torch's own compiler applies to frozen
            linears), which shortens a decode step's products.

The figures behind these choices: docs/benchmarks.md, "Design measurements quoted from
the code".

Anything else (GPU, float16, a torch without MKL / oneDNN) keeps its dense weight.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

# Row count the packing is told to expect. Neither library's packed layout depends on it
# (MKL's packed size is the same for 1..512 rows); it only tunes the blocking.
PACK_ROWS_HINT = 64


def onednn_packing_available() -> bool:
    """True when this torch can reorder a linear weight for oneDNN ahead of time."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def mkl_packing_available() -> bool:
    """True when this torch exposes MKL's packed sgemm."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


FLOAT32_GEMM_ENV = "LLMSERVE_CPU_FP32_GEMM"
FLOAT32_GEMMS = ("auto", "mkl", "onednn", "dense")


def cpu_vendor() -> str:
    """The CPU's vendor id (GenuineIntel, AuthenticAMD, ...) from /proc/cpuinfo; "" elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def float32_gemm() -> str:
    """Which layout float32 CPU weights take: "mkl", "onednn" or "dense" (see above).

    NOTE: chosen by vendor, not timed at load: the two libraries sum in different orders,
    and a choice that flipped between processes on a noisy host could flip a greedy
    near-tie between an engine and its own cluster."""
    choice = os.environ.get(FLOAT32_GEMM_ENV, "auto").strip().lower() or "auto"
    if choice not in FLOAT32_GEMMS:
        raise ValueError(f"{FLOAT32_GEMM_ENV}={choice!r}: expected one of {', '.join(FLOAT32_GEMMS)}")
    if choice == "auto":
        choice = "mkl" if cpu_vendor() == "GenuineIntel" else "onednn"
    if choice == "mkl" and not mkl_packing_available():
        choice = "onednn"
    if choice == "onednn" and not onednn_packing_available():
        choice = "mkl" if mkl_packing_available() else "dense"
    return choice


def _mkl_linear(x: torch.Tensor, packed: torch.Tensor, shape: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # NOTE: `_mkl_linear` takes the packed path only when its last argument equals the
    # input's row count, and otherwise multiplies by `shape` (here a stride-0 stand-in that
    # only carries [out, in]). Passing the actual row count always takes the packed path:
    # MKL's packed B is laid out by (N, K) alone, so one packing serves every row count,
    # which `mkl_packed_rows_agree` checks once per shape before any weight is packed.
    return torch.ops.mkl._mkl_linear(x, packed, shape, bias, x.shape[0])


@functools.lru_cache(maxsize=None)
def mkl_packed_rows_agree(out_features: int, in_features: int) -> bool:
    """True when an MKL-packed [out, in] weight multiplies like the dense one at row counts
    other than the packing hint (1, 5, 17, 64, 100): the guard on the reuse above."""
    gen = torch.Generator().manual_seed(out_features * 1_000_003 + in_features)
    w = torch.randn(out_features, in_features, generator=gen)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS_HINT)
    shape = torch.zeros(1).expand(out_features, in_features)
    for rows in (1, 5, 17, PACK_ROWS_HINT, 100):
        x = torch.randn(rows, in_features, generator=gen)
        want = (x.double() @ w.double().t()).float()
        got = _mkl_linear(x, packed, shape, None)
        # fp32 dot products of length in_features: a few ulps of the largest partial sum.
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * in_features**0.5):
            log.warning("MKL packed sgemm disagrees at %d rows for %dx%d; using dense weights",
                        rows, out_features, in_features)
            return False
    return True


class PackedWeight:
    """y = x @ W.T (+ b) for a CPU weight W [out_features, in_features] held packed."""

    def __init__(self, kind: str, packed: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype):
        self.kind = kind  # "mkl" | "onednn"
        self.packed = packed  # opaque (mkldnn layout) tensor
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self._shape = torch.zeros(1, dtype=dtype).expand(out_features, in_features)  # no storage

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight | None:
        """The packed form of `weight` [out, in], or None if this device/dtype keeps it dense."""
        if weight.device.type != "cpu" or weight.dim() != 2:
            return None
        out_features, in_features = weight.shape
        w = weight.detach().contiguous()
        if weight.dtype == torch.float32:
            gemm = float32_gemm()
            if gemm == "mkl" and mkl_packed_rows_agree(out_features, in_features):
                packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS_HINT)
                return cls("mkl", packed, out_features, in_features, weight.dtype)
            if gemm != "onednn":
                return None
        if weight.dtype in (torch.float32, torch.bfloat16) and onednn_packing_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
            return cls("onednn", packed, out_features, in_features, weight.dtype)
        return None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [rows, in_features] -> [rows, out_features]
        x = x.contiguous()
        if self.kind == "mkl":
            return _mkl_linear(x, self.packed, self._shape, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
