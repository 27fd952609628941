"""CPU kernels in C++ (built on first use with torch's extension builder).

On CPU, decode attention over a paged KV cache is memory-bound; gathering each
sequence's blocks into a contiguous tensor first (what plain torch must do) moves
every K/V byte three times: `paged_attention_decode` reads the blocks in place.
The element-wise ops (RMSNorm with the residual add, SiLU-and-multiply, rotary
embedding) each replace a chain of torch ops with one pass over the activations;
`rotary_and_write_kv_` also stores the rotated keys and the values in the paged cache
in that pass. `paged_attention_prefill` is flash attention for prefill and chunk rows,
reading the paged cache in place too, with bfloat16 products on AMX tiles or AVX-512 BF16
(torch's fused CPU SDPA kernel runs bfloat16 at a few % of the bfloat16 GEMM rate). The
linear products (`bf16_linear`, `w8a8_linear`) run on AMX tiles where the CPU has them
(amx.h), else in AVX-512 registers.

Every op has a plain torch equivalent in the layers, used when `available()` is False
(no compiler, `LLMSERVE_DISABLE_CPU_KERNELS=1`) and as the reference in tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

from llmserve.kernels.cpu.host import cpu_facts

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "paged_attention_decode.cpp", _CSRC / "elementwise.cpp", _CSRC / "int8_linear.cpp",
            _CSRC / "bf16_linear.cpp", _CSRC / "rotary_kv_write.cpp", _CSRC / "paged_attention_prefill.cpp",
            _CSRC / "argmax_rows.cpp", _CSRC / "decoder_layers.cpp", _CSRC / "amx_bf16.cpp",
            _CSRC / "amx_int8.cpp", _CSRC / "f32_linear.cpp"]


@lru_cache(maxsize=1)
def source_key() -> str:
    """A digest of the kernels' sources: what a build, and a timing of it, belong to."""
    return hashlib.sha1(b"".join(s.read_bytes() for s in sorted(_CSRC.iterdir()))).hexdigest()[:10]


def _build_dir() -> Path:
    # -march=native code is only valid on the CPU it was built for: key the cache on it,
    # and on the sources, so an edited kernel is rebuilt rather than loaded stale. And on
    # the torch installation: torch's builder records the include paths it built with
    # and rebuilds for any other, so two virtual environments sharing one directory
    # rebuilt the kernels in turn (~70 s each, every time a process of the other one
    # started: a test suite's clusters waited 10 minutes on the build lock).
    cpu_key = hashlib.sha1(cpu_facts().key.encode()).hexdigest()[:10]
    install_key = hashlib.sha1(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
    root = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))
    path = root / "torch_extensions" / f"{torch.__version__}-{cpu_key}-{source_key()}-{install_key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive(build_dir: Path):
    """One builder per machine, by a lock the OS drops when its holder dies.

    torch's extension builder guards a build with a plain `lock` file that only a clean
    exit removes: a worker killed mid-build left it behind, and every later worker waited
    on it forever, silently. Under this flock nobody else is building, so a `lock` file
    found here is such a leftover and goes."""
    with open(build_dir / "llmserve-build.flock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish building the CPU kernels in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a CPU-kernel build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


@lru_cache(maxsize=1)
def load() -> bool:
    """Builds (once per machine) and loads the ops; False if that is impossible here."""
    if os.environ.get("LLMSERVE_DISABLE_CPU_KERNELS") == "1":
        return False
    try:
        from torch.utils.cpp_extension import load as build

        build_dir = _build_dir()
        with _exclusive(build_dir):
            build(name="llmserve_cpu_kernels", sources=[str(s) for s in _SOURCES], build_directory=str(build_dir),
                  extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], is_python_module=False,
                  verbose=False)
        return True
    except Exception as err:  # No compiler, no headers: the torch path still works.
        logger.warning("CPU kernels unavailable (%s); using plain torch ops", err)
        return False


def usable_for(x: torch.Tensor) -> bool:
    """True when the fused element-wise CPU ops apply to this activation tensor
    (float32 and bfloat16; float16 is impractically slow on CPU anyway)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and load()


def paged_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """q [B, H, D] (its rows at any stride: a view of the fused qkv output is read in place),
    kv_cache [2, NB, BS, KVH, D], block_tables [B, max_blocks] int64, seq_lens [B] int64 ->
    [B, H, D]. window W: each row attends to its last W keys only, and reads no block before
    them; softcap c: scores -> c * tanh(scores / c). None = off."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    return torch.ops.llmserve_cpu.paged_attention_decode(q, kv_cache, block_tables, seq_lens, scale,
                                                         window or 0, softcap or 0.0)


def paged_attention_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of N prefill/chunk rows over their cached context and themselves, the
    keys read in place: q [T, H, D] (sequence n's queries are rows query_start_loc[n] ..
    query_start_loc[n+1]-1, at positions seq_lens[n] - their count onwards), kv_cache
    [2, NB, BS, KVH, D] holding every key up to seq_lens[n], block_tables [N, max_blocks],
    query_start_loc [N + 1], seq_lens [N], all int64; float32 or bfloat16 -> [T, H, D].
    window W: a query at position p sees keys (p - W, p] and no block wholly before its
    chunk's first window is read; softcap c: scores -> c * tanh(scores / c). None = off."""
    return torch.ops.llmserve_cpu.paged_attention_prefill(q.contiguous(), kv_cache, block_tables, query_start_loc,
                                                          seq_lens, scale, window or 0, softcap or 0.0)


@lru_cache(maxsize=1)
def prefill_bf16_dot_supported() -> bool:
    """True when paged_attention_prefill multiplies bfloat16 with AVX-512 BF16 (else in float32)."""
    return load() and bool(torch.ops.llmserve_cpu.prefill_bf16_dot_supported())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> weight * x / rms(x)  [T, H]"""
    return torch.ops.llmserve_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual; returns (rms_norm(s), s), written over x and residual."""
    x, residual = x.contiguous(), residual.contiguous()
    torch.ops.llmserve_cpu.fused_add_rms_norm_(x, residual, weight, eps)
    return x, residual


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [S, V] float32 or bfloat16 (rows contiguous) -> [S] int64: each row's first largest
    value's index."""
    return torch.ops.llmserve_cpu.argmax_rows(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2d] laid out [gate | up] -> silu(gate) * up  [T, d]"""
    return torch.ops.llmserve_cpu.silu_and_mul(x)


def rotary_neox_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """In place on the first `heads` heads of each row of x [T, >= heads*D] (e.g. the q and
    k heads of a fused qkv output); cos, sin [T, D/2]."""
    torch.ops.llmserve_cpu.rotary_neox_(x, cos, sin, heads, head_dim)


def rotary_and_write_kv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """qkv [T, (H + 2*KVH) * D] laid out [q | k | v]: the first R = 2 * cos.shape[-1] dims of
    each q and k head rotated in place (cos, sin [T, R/2] or [T, 1, R/2]), then each token's k
    and v rows stored at its flat slot of kv_cache [2, NB, BS, KVH, D] (slot_mapping [T] int64;
    -1: a padding token, stored nowhere)."""
    torch.ops.llmserve_cpu.rotary_and_write_kv_(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads,
                                                head_dim)


def w8a8_supported() -> bool:
    """True when the kernels were built with AVX-512 VNNI, which the W8A8 int8 GEMM needs."""
    return load() and bool(torch.ops.llmserve_cpu.w8a8_supported())


def w8a8_pack_weight(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 (N % 16 == 0, K % 64 == 0) -> [N/16, K/4, 16, 4] uint8 holding q + 128."""
    return torch.ops.llmserve_cpu.w8a8_pack_weight(q)


W8A8_ENGINES = {"auto": 0, "vnni": 1, "amx": 2}


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor, engine: str = "auto") -> torch.Tensor:
    """x [M, K] float32/bfloat16, quantized per row and group of 64 columns; packed from
    w8a8_pack_weight; w_scale [N] float32 -> y [M, N] in x's dtype. engine: "auto" (AMX
    tiles where usable, else AVX-512 VNNI registers: the same bits either way), or "vnni" /
    "amx" by name (benchmarks, tests)."""
    return torch.ops.llmserve_cpu.w8a8_linear(x, packed, w_scale, W8A8_ENGINES[engine])


def bf16_tiles_supported() -> bool:
    """True when the kernels were built with AVX-512 BF16, which bf16_linear needs."""
    return load() and bool(torch.ops.llmserve_cpu.bf16_tiles_supported())


def bf16_pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bfloat16 (N % 16 == 0, K even) -> [N/16, K/2, 16, 2] bfloat16."""
    return torch.ops.llmserve_cpu.bf16_pack_weight(w)


def amx_supported() -> bool:
    """True when bf16_linear and w8a8_linear can multiply on AMX tiles here (built with
    AMX-BF16 and AMX-INT8, the OS lets this process use the tile registers, and
    LLMSERVE_CPU_AMX is not 0)."""
    return load() and bool(torch.ops.llmserve_cpu.amx_supported())


BF16_ENGINES = {"auto": 0, "avx512": 1, "amx": 2}


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, engine: str = "auto") -> torch.Tensor:
    """x [M, K] bfloat16 @ W.T for W packed by bf16_pack_weight -> y [M, N] bfloat16.
    engine: "auto" (AMX tiles where usable and K % 32 == 0, else AVX-512 BF16 registers),
    or "avx512" / "amx" by name (benchmarks, tests)."""
    return torch.ops.llmserve_cpu.bf16_linear(x, packed, BF16_ENGINES[engine])


def interleave_gate_up_blocks(packed: torch.Tensor) -> torch.Tensor:
    """A gated MLP's merged [gate; up] weight packed by bf16_pack_weight, [2d/16, K/2, 16, 2]
    -> the same blocks in the order bf16_linear_silu_mul reads them: gate block j, then up
    block j, for j = 0 .. d/16 - 1 (a new tensor; d % 16 == 0)."""
    blocks = packed.shape[0]
    if blocks % 2:
        raise ValueError(f"interleave_gate_up_blocks: {blocks} blocks do not split into gate and up halves")
    return packed.view(2, blocks // 2, *packed.shape[1:]).transpose(0, 1).reshape(packed.shape).contiguous()


def bf16_linear_silu_mul(x: torch.Tensor, interleaved: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 -> silu(x @ G.T) * (x @ U.T) [M, d] bfloat16 on AMX tiles, for the
    merged [G; U] weight packed and then interleave_gate_up_blocks'd; bit for bit
    silu_and_mul(bf16_linear(x, plain packing)). Needs amx_supported() and K % 32 == 0."""
    return torch.ops.llmserve_cpu.bf16_linear_silu_mul(x, interleaved)


def f32_tiles_supported() -> bool:
    """True when the kernels were built with AVX-512 F, which f32_linear needs."""
    return load() and bool(torch.ops.llmserve_cpu.f32_tiles_supported())


def f32_pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float32 (N % 16 == 0) -> [N/16, K, 16] float32."""
    return torch.ops.llmserve_cpu.f32_pack_weight(w)


def f32_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W.T for W packed by f32_pack_weight -> y [M, N] float32, each
    output summed over k in order (a row's result does not depend on the other rows)."""
    return torch.ops.llmserve_cpu.f32_linear(x, packed)


def decoder_layers(hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor, num_decodes: int,
                   decode_tables: torch.Tensor | None, decode_lens: torch.Tensor | None,
                   prefill_tables: torch.Tensor | None, prefill_query_start: torch.Tensor | None,
                   prefill_lens: torch.Tensor | None, norms: list[torch.Tensor], weights: list[torch.Tensor],
                   extras: list[torch.Tensor], biases: list[torch.Tensor], kinds: list[int], num_heads: int,
                   num_kv_heads: int, head_dim: int, eps: float, scale: float, windows: list[int],
                   softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's L decoder layers (pre-norm, rotary attention over the paged cache, SiLU-gated
    MLP) in one call, the ops of the eager layers in their order: hidden [T, E] (and the
    residual stream [T, E], None before the first layer) -> (hidden, residual) after the
    last. Rows 0..num_decodes-1 are decodes (decode_tables / decode_lens as
    paged_attention_decode takes them), the rest prefill rows (the prefill_* tensors as
    paged_attention_prefill takes them). Per layer 2 norm weights, and per projection (qkv,
    o, gate_up, down) a weight, an extra tensor, a bias (empty: none) and its kind
    (decoder_layers.cpp)."""
    return torch.ops.llmserve_cpu.decoder_layers(hidden, residual, cos, sin, kv_caches, slot_mapping, num_decodes,
                                                 decode_tables, decode_lens, prefill_tables, prefill_query_start,
                                                 prefill_lens, norms, weights, extras, biases, kinds, num_heads,
                                                 num_kv_heads, head_dim, eps, scale, windows, softcap)
