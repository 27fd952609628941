"""CPU weights reordered once, at load, into the layout of the library that multiplies
them fastest, then held only in that layout (the dense copy is released).

  float32:  MKL's packed-GEMM format (cblas_sgemm_pack / sgemm_compute, through
            torch's `mkl::_mkl_linear`), oneDNN's blocked layout, or, where the CPU
            kernels were built with AVX-512, the 16-channel blocks of our kernel
            (llmserve_cpu::f32_linear, the bfloat16 kernel's register tiles with FMAs),
            whichever multiplies decode-sized products fastest on this machine: timed
            once per machine (CPU flags, torch version, our kernels' sources) and kept in
            the cache directory, so every process of a machine uses the same one. (Of
            the two libraries oneDNN won by far on the AMD EPYCs, where MKL takes slower
            kernels, and either won by ~10% on the Intel Xeons measured; a rule by vendor
            name would break on the next CPU that differs.) LLMSERVE_CPU_FP32_GEMM =
            tiles | mkl | onednn | dense overrides the choice. A shape our kernel cannot
            take (out % 16) keeps a library's layout.
  bfloat16: oneDNN's blocked layout (the reorder torch's own compiler applies to frozen
            linears), or, where the CPU kernels were built with AVX-512 BF16, the
            16-channel blocks of our kernel (llmserve_cpu::bf16_linear: on AMX tiles
            where the CPU has AMX-BF16, else in AVX-512 BF16 registers; the blocks are
            AMX's own B-tile layout), whichever multiplies decode-sized products faster:
            timed and remembered the same way. LLMSERVE_CPU_BF16_GEMM = tiles | onednn |
            dense overrides it. A shape our kernel cannot take (out % 16, odd in) keeps
            oneDNN's layout. On AMX a SiLU-gated MLP's merged gate/up weight has its
            blocks interleaved at load (GatedMLP), so that one product also applies
            silu(gate) * up as its tiles are stored (bf16_linear_silu_mul).

The figures behind these choices: docs/benchmarks.md, "Design measurements quoted from
the code".

Anything else (GPU, float16, a torch without MKL / oneDNN) keeps its dense weight.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels.cpu.host import cpu_facts, last_level_cache_bytes
from llmserve.worker import huge_pages

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
FLOAT32_GEMMS = ("auto", "tiles", "mkl", "onednn", "dense")
BFLOAT16_GEMM_ENV = "LLMSERVE_CPU_BF16_GEMM"
BFLOAT16_GEMMS = ("auto", "tiles", "onednn", "dense")
TILE_BLOCK = 16  # output channels per block of our bfloat16 and float32 layouts (gemm_tiles.h)


def tiles_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when our GEMM kernel for `dtype` was built for this CPU: bfloat16 needs
    AVX-512 BF16 (and multiplies on AMX-BF16 where the CPU has it), float32 AVX-512 F."""
    if dtype == torch.float32:
        return cpu_kernels.f32_tiles_supported()
    return cpu_kernels.bf16_tiles_supported()


def tiles_fit(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    return out_features % TILE_BLOCK == 0 and (dtype == torch.float32 or in_features % 2 == 0)


# Decode-shaped products the choice is timed on: rows x [out, in] (a 0.5B-1B model's
# projections at a batch of 8).
TIMED_SHAPES = ((8, 2048, 2048), (8, 8192, 2048), (8, 2048, 8192))


def timed_cases(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x [rows, in], w [out, in]) of TIMED_SHAPES in `dtype`, the same values every call."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype))
            for rows, n, k in TIMED_SHAPES]


def cold_copies(weight_bytes: int) -> int:
    """How many copies of `weight_bytes` of weights a timing cycles through so that no
    call finds its weight in the last-level cache: 1.5x its size, within 1 GiB."""
    fit = max(1, 2**30 // weight_bytes)
    return min(fit, max(1, math.ceil(1.5 * last_level_cache_bytes() / weight_bytes)))


def alternated_best_seconds(rounds: dict[str, list[Callable[[], object]]], repeats: int = 7,
                            passes: int = 5) -> dict[str, float]:
    """name -> seconds of its fastest round (`passes` passes over its products), the names
    taking turns round by round: a neighbour's burst on a shared host then slows every
    name, not whichever happened to be timed during it."""
    best = dict.fromkeys(rounds, float("inf"))
    for _ in range(repeats):
        for name, products in rounds.items():
            start = time.perf_counter()
            for _ in range(passes):
                for product in products:
                    product()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _time_layouts(dtype: torch.dtype, available: dict[str, Callable[[], bool]]) -> dict[str, float]:
    """Seconds per round (each timed product 5 times) in `dtype` for each packed layout
    whose availability check passes here, each weight read from memory as a decode step
    reads it, the layouts taking turns.

    NOTE: from memory, not from cache: on a Xeon with a 300 MiB last-level cache the same
    three weights called again and again stayed in it, and oneDNN's bfloat16 layout timed
    ~7% faster than our kernel on AMX, which from memory is 1.2-1.6x faster at 8 rows
    (`llmserve bench gemm`). And in turns: one layout's 7 rounds and then the other's
    chose by whichever a noisy neighbour slowed."""
    cases = timed_cases(dtype)
    copies = cold_copies(sum(w.numel() * w.element_size() for _, w in cases))
    rounds = {}
    for kind, is_available in available.items():
        if is_available():
            packed = [(x, PackedWeight.packed_as(kind, w)) for _ in range(copies) for x, w in cases]
            rounds[kind] = [functools.partial(p.matmul, x) for x, p in packed]
    # Every call reads a weight no call touched since its last pass over copies x the
    # cases, so a round costs copies x the cases' products 5 times.
    return {kind: seconds / copies for kind, seconds in alternated_best_seconds(rounds).items()}


def _time_float32_gemms() -> dict[str, float]:
    return _time_layouts(torch.float32, {"tiles": functools.partial(tiles_available, torch.float32),
                                         "mkl": mkl_packing_available, "onednn": onednn_packing_available})


def _time_bfloat16_gemms() -> dict[str, float]:
    return _time_layouts(torch.bfloat16, {"tiles": tiles_available, "onednn": onednn_packing_available})


def _machine_key() -> str:
    """CPU model and flags, torch's version and our kernels' sources.

    NOTE: the sources too: a timing of our kernels holds for the build it timed. Without
    them a machine keeps a choice made against an older build, e.g. oneDNN's bfloat16
    layout after a change to our tiles made them the faster (the 8-row tiles: 64-row
    products ~10% faster on a Zen 5 EPYC)."""
    key = f"{cpu_facts().key}|{torch.__version__}|{cpu_kernels.source_key()}"
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def remembered(name: str, measure: Callable[[], dict]) -> dict:
    """`measure()`'s result for this machine (CPU model, flags, torch version, our
    kernels' sources: _machine_key): computed by the first process that asks and kept in
    the cache directory. NOTE: under a lock, so processes starting together do not each
    time it on a contended CPU and disagree; and kept, so a noisier later run cannot flip
    a choice that changes numerics."""
    root = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve")) / "cpu-gemm"
    root.mkdir(parents=True, exist_ok=True)
    record = root / f"{name}-{_machine_key()}.json"
    # One lock per record: a measurement may need another one first (bfloat16's is timed
    # against float32 in the layout float32's own measurement picks).
    with open(record.with_suffix(".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if record.exists():
            return json.loads(record.read_text())
        result = measure()
        record.write_text(json.dumps(result))
        log.info("%s, measured once on this machine: %s (%s)", name, result, record)
        return result


def _measured_layout(name: str, time_layouts: Callable[[], dict[str, float]]) -> str:
    """The layout with the fastest round in `time_layouts()`, timed once per machine and
    remembered under `name` ("dense" when no layout can be packed here)."""
    def measure() -> dict:
        times = time_layouts()
        return {"choice": min(times, key=times.get) if times else "dense", "seconds": times}

    return remembered(name, measure)["choice"]


def _layout_setting(env: str, choices: tuple[str, ...]) -> str:
    """The layout `env` asks for ("auto" when unset)."""
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in choices:
        raise ValueError(f"{env}={choice!r}: expected one of {', '.join(choices)}")
    return choice


def measured_float32_gemm() -> str:
    """The fastest packed float32 layout on this machine: "tiles", "mkl", "onednn"
    ("dense" if none can be packed here)."""
    return _measured_layout("float32-gemm", lambda: _time_float32_gemms())


@functools.lru_cache(maxsize=None)
def float32_gemm() -> str:
    """Which layout float32 CPU weights take: "tiles", "mkl", "onednn" or "dense" (see
    above).

    NOTE: timed once per machine and remembered, not per process: the layouts sum in
    different orders, and a choice that flipped between processes on a noisy host could
    flip a greedy near-tie between an engine and its own cluster."""
    choice = _layout_setting(FLOAT32_GEMM_ENV, FLOAT32_GEMMS)
    return _usable_float32_layout(measured_float32_gemm() if choice == "auto" else choice)


def _usable_float32_layout(choice: str) -> str:
    """`choice`, or the layout that stands in for it where this build or torch cannot
    pack it: tiles -> MKL -> oneDNN (-> MKL) -> dense."""
    if choice == "tiles" and not tiles_available(torch.float32):
        choice = "mkl"
    if choice == "mkl" and not mkl_packing_available():
        choice = "onednn"
    if choice == "onednn" and not onednn_packing_available():
        choice = "mkl" if mkl_packing_available() else "dense"
    return choice


@functools.lru_cache(maxsize=None)
def bfloat16_gemm() -> str:
    """Which layout bfloat16 CPU weights take: "tiles", "onednn" or "dense" (see above);
    timed once per machine and remembered, like float32_gemm()."""
    choice = _layout_setting(BFLOAT16_GEMM_ENV, BFLOAT16_GEMMS)
    if choice == "auto":
        choice = _measured_layout("bfloat16-gemm", lambda: _time_bfloat16_gemms())
    if choice == "tiles" and not tiles_available():
        choice = "onednn"
    if choice == "onednn" and not onednn_packing_available():
        choice = "dense"
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
        self.kind = kind  # "mkl" | "onednn" | "tiles"
        # opaque (mkldnn layout) tensor, or for "tiles" [out/16, in/2, 16, 2] bfloat16 / [out/16, in, 16] float32
        self.packed = packed
        # bfloat16 "tiles" of a gated MLP's merged [gate; up] weight only: blocks reordered
        # gate 0, up 0, gate 1, up 1, ... for bf16_linear_silu_mul (interleave_gate_up).
        self.gate_up_interleaved = False
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        # [out, in] at stride 0 (no storage): the shape _mkl_linear is given beside the packed weight
        self.shape_standin = torch.zeros(1, dtype=dtype).expand(out_features, in_features)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight | None:
        """The packed form of `weight` [out, in], or None if this device/dtype keeps it dense."""
        if weight.device.type != "cpu" or weight.dim() != 2:
            return None
        out_features, in_features = weight.shape
        w = weight.detach().contiguous()
        if weight.dtype == torch.float32:
            gemm = float32_gemm()
            if gemm == "tiles":
                if tiles_fit(out_features, in_features, torch.float32):
                    return cls.packed_as("tiles", w)
                gemm = _usable_float32_layout("mkl")  # (a library's layout: out % 16)
            if gemm == "mkl" and mkl_packed_rows_agree(out_features, in_features):
                return cls.packed_as("mkl", w)
            if gemm != "onednn":
                return None
        if weight.dtype == torch.bfloat16:
            gemm = bfloat16_gemm()
            if gemm == "tiles" and tiles_fit(out_features, in_features):
                return cls.packed_as("tiles", w)
            if gemm == "dense":
                return None
        if weight.dtype in (torch.float32, torch.bfloat16) and onednn_packing_available():
            return cls.packed_as("onednn", w)
        return None

    @classmethod
    def packed_as(cls, kind: str, w: torch.Tensor) -> PackedWeight:
        """`w` [out, in] (contiguous, CPU) reordered for `kind`: "mkl", "onednn" or "tiles"."""
        if kind == "tiles":
            packed = cpu_kernels.f32_pack_weight(w) if w.dtype == torch.float32 else cpu_kernels.bf16_pack_weight(w)
        elif kind == "mkl":
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS_HINT)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        # (oneDNN's and MKL's are opaque tensors: huge_pages.moved leaves them where they are)
        return cls(kind, huge_pages.moved(packed), w.shape[0], w.shape[1], w.dtype)

    def silu_mul_fits(self) -> bool:
        """Whether bf16_linear_silu_mul can take this weight as a gated MLP's merged [gate;
        up]: bfloat16 tiles on AMX, K % 32 == 0, whole blocks in each half."""
        return (self.kind == "tiles" and self.dtype == torch.bfloat16 and cpu_kernels.amx_supported()
                and self.in_features % 32 == 0 and self.out_features % (2 * TILE_BLOCK) == 0)

    def interleave_gate_up(self) -> None:
        """Reorder the blocks for silu_mul (in place of the plain order: the weight stays
        held once); matmul still returns [gate | up]."""
        assert self.silu_mul_fits() and not self.gate_up_interleaved
        self.packed = huge_pages.moved(cpu_kernels.interleave_gate_up_blocks(self.packed))
        self.gate_up_interleaved = True

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> silu(gate) * up [rows, out/2], in one pass (interleave_gate_up first)."""
        return cpu_kernels.bf16_linear_silu_mul(x, self.packed)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [rows, in_features] -> [rows, out_features]
        if self.kind == "tiles":  # (the kernels make x contiguous themselves)
            linear = cpu_kernels.f32_linear if self.dtype == torch.float32 else cpu_kernels.bf16_linear
            y = linear(x, self.packed)
            if self.gate_up_interleaved:  # [rows, d/16, (gate, up), 16] -> [rows, gate | up]
                y = y.view(y.shape[0], -1, 2, TILE_BLOCK).transpose(1, 2).reshape(y.shape)
            return y if bias is None else y + bias
        x = x.contiguous()
        if self.kind == "mkl":
            return _mkl_linear(x, self.packed, self.shape_standin, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
