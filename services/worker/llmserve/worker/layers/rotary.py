"""Rotary position embedding, rotate-half (neox) layout as in HF Llama.

For x = [x1 | x2 | x_pass] at position p (x1, x2 of rotary_dim/2 each; x_pass the last
head_dim - rotary_dim dims, kept as they are: partial rotary, e.g. Phi-4-mini's 0.75):
  out = [x1*cos - x2*sin | x2*cos + x1*sin | x_pass],  cos/sin = m * cos/sin(p * inv_freq)
inv_freq [rotary_dim/2] and the attention factor m (1 except yarn and longrope) follow
transformers' `ROPE_INIT_FUNCTIONS` for each `rope_type`.

NOTE: transformers picks two of the types per forward from the current sequence length;
an engine with one per-position table (shared by every sequence, cached keys reused for
many steps) cannot, and picks once for the whole table, as HF would for a sequence that
fills it (`max_position` rows, the model's max_position_embeddings):
  longrope  long factors when max_position > original_max_position_embeddings, short
            ones otherwise. HF uses short factors for every forward whose sequence fits
            the original length, so on an extended model (Phi-3-128k, Phi-4-mini) prompts
            of up to 4096 tokens get other angles here than in HF (HF's own generate then
            mixes the two: keys cached with short factors, later queries rotated with
            long ones). One set for all positions keeps q.k a function of p - j only.
  dynamic   NTK base for a sequence of max_position tokens; HF grows the base only once
            a sequence exceeds max_position_embeddings, so with the default table
            (max_position == max_position_embeddings) this is plain RoPE, equal to HF for
            every sequence the model accepts. A longer table differs from HF for sequences
            shorter than it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.kernel_op import fused_cpu_applies

# Keys the scaled types read from the config itself rather than from its RoPE dict.
_CONFIG_KEYS = ("max_position_embeddings", "partial_rotary_factor")
_NEEDS_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def rope_parameters(config: Any) -> dict:
    """transformers 5 keeps RoPE settings in `config.rope_parameters`; older configs use
    `rope_theta` + `rope_scaling`. Also carries the config-level values some types read
    (max_position_embeddings, partial_rotary_factor, Phi-3's top-level
    original_max_position_embeddings); Phi-3's older name 'su' becomes 'longrope'."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    for key in _CONFIG_KEYS:
        if getattr(config, key, None) is not None:
            params.setdefault(key, getattr(config, key))
    if params["rope_type"] in _NEEDS_ORIGINAL_LENGTH:
        # NOTE: Phi-3 stores the pretraining length beside rope_scaling; HF gives it priority.
        original = getattr(config, "original_max_position_embeddings", None) or params.get(
            "original_max_position_embeddings", params.get("max_position_embeddings"))
        if original is not None:
            params["original_max_position_embeddings"] = original
    return params


def _inv_freq(base: float, dim: int) -> torch.Tensor:
    """[dim/2] float32: base^(-2i/dim)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))


# Each: (params, rotary_dim, table length) -> (inv_freq [rotary_dim/2] float32, attention factor)
_InitFn = Callable[[dict, int, int], "tuple[torch.Tensor, float]"]


def _default(p: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    return _inv_freq(p["rope_theta"], dim), 1.0


def _linear(p: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency divided by `factor`."""
    return _inv_freq(p["rope_theta"], dim) / p["factor"], 1.0


def _dynamic(p: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """NTK-aware base for a sequence of `max_position` tokens (see the module note)."""
    trained = p.get("max_position_embeddings", max_position)
    seq_len, factor = max(max_position, trained), p["factor"]
    base = p["rope_theta"] * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
    return _inv_freq(base, dim), 1.0


def _yarn(p: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, a
    linear ramp over the dims between; cos/sin scaled by 0.1 ln(factor) + 1 (mscale)."""
    base, original = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or p.get("max_position_embeddings", max_position) / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def _longrope(p: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): a per-frequency divisor, short or long set (see the module note);
    cos/sin scaled by sqrt(1 + ln(factor) / ln(original length))."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or p.get("max_position_embeddings", max_position) / original
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(p["long_factor"] if max_position > original else p["short_factor"], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(f"longrope: {len(ext)} factors for rotary dim {dim} (need {dim // 2})")
    return 1.0 / (ext * p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), attention


def _llama3(p: dict, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend between."""
    inv_freq = _inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out), 1.0


ROPE_TYPES: dict[str, _InitFn] = {
    "default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "longrope": _longrope,
    "llama3": _llama3,
}


def rope_inv_freq(params: dict, head_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] float32 on the host, attention factor) for `params`."""
    rope_type = params.get("rope_type", "default")
    init = ROPE_TYPES.get(rope_type)
    if init is None:
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(map(repr, ROPE_TYPES))})")
    return init(params, rotary_dim_of(head_dim, params), max_position)


def rotary_dim_of(head_dim: int, params: dict) -> int:
    """The leading dims of each head that rotate (all of them unless partial_rotary_factor < 1)."""
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"rotary dim {dim} (head_dim {head_dim} x partial_rotary_factor) must be even and > 0")
    return dim


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype | None = None):
        super().__init__()
        # NOTE: the tables are computed on the host in float32 whatever the device, so a
        # GPU rank's angles are bit-identical to a CPU rank's; then moved where the model lives.
        device = torch.empty(0).device
        inv_freq, attention_factor = rope_inv_freq(params, head_dim, max_position)
        self.rotary_dim = 2 * inv_freq.shape[0]
        # cos, sin: [max_position, rotary_dim // 2], computed (and scaled by the attention
        # factor, as HF scales its cos/sin) in float32, stored in model dtype
        freqs = torch.arange(max_position, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None, :]
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("cos", (freqs.cos() * attention_factor).to(device, dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_factor).to(device, dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        """positions: [T] -> this step's angles, computed once per step and shared by every
        layer through `apply_rotary_qkv`. On CUDA the Triton kernel reads the tables at
        `positions` itself; elsewhere the rows are gathered here ([T, 1, R/2] each)."""
        if positions.is_cuda:
            return Rope(self.cos, self.sin, positions)
        return Rope(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class Rope(NamedTuple):
    """cos, sin: [T, 1, R/2], one row per token (positions None); or, on CUDA, the whole
    tables [max_position, R/2] and the token positions [T] that index them. R is the
    rotary dim (head_dim unless partial)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None = None


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # x: [T, heads, R]; cos, sin: [T, 1, R/2]
    cos, sin = cos_sin[0], cos_sin[1]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_qkv(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                     num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused projection output -> rotated q, k and v.

    qkv: [T, (H + 2*KVH) * D] laid out [q | k | v] -> q [T, H, D], k [T, KVH, D], v [T, KVH, D]
    (views of qkv). On CPU (C++) and CUDA (Triton) the q and k heads are rotated in
    place in one pass. With partial rotary (cos/sin narrower than D/2) only the first
    R = 2 * cos.shape[-1] dims of each head rotate.
    """
    T = qkv.shape[0]
    cos, sin = cos_sin[0], cos_sin[1]
    rotary_dim = 2 * cos.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    positions = cos_sin[2] if len(cos_sin) > 2 else None
    if positions is not None:  # CUDA: the Triton kernel rotates q and k in place in one launch
        from llmserve.kernels.triton import rotary_embedding

        q, k, v = (t.view(T, n, head_dim) for t, n in zip(qkv.split([q_size, kv_size, kv_size], dim=-1),
                                                          (num_heads, num_kv_heads, num_kv_heads)))
        # (partial: views [T, heads, R] of the rotating dims; the kernel takes head strides)
        rotary_embedding(positions, q[..., :rotary_dim], k[..., :rotary_dim], cos, sin, is_neox=True)
        return q, k, v
    if rotary_dim < head_dim:
        return _apply_partial_rotary_qkv(qkv, cos_sin, num_heads, num_kv_heads, head_dim)
    if cos.dtype == qkv.dtype and fused_cpu_applies(qkv):
        cpu_kernels.rotary_neox_(qkv, cos.reshape(T, -1), sin.reshape(T, -1), num_heads + num_kv_heads, head_dim)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim), v.view(T, num_kv_heads, head_dim)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim)
    return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin), v.view(T, num_kv_heads, head_dim)


def rotary_kv_write_applies(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], kv_cache: torch.Tensor) -> bool:
    """True when one C++ pass can rotate q and k and store k and v in the cache
    (`apply_rotary_qkv_and_write_kv`): host cos/sin rows (not CUDA positions) in qkv's
    dtype, and a contiguous cache of that dtype on the CPU."""
    on_host = len(cos_sin) == 2 or cos_sin[2] is None
    return (on_host and cos_sin[0].dtype == qkv.dtype == kv_cache.dtype and kv_cache.is_contiguous()
            and fused_cpu_applies(qkv))


def apply_rotary_qkv_and_write_kv(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], num_heads: int,
                                  num_kv_heads: int, head_dim: int, kv_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`apply_rotary_qkv` (full or partial rotary), and k and v stored at their slots of
    kv_cache [2, num_blocks, block_size, KVH, D], in one pass: where
    `rotary_kv_write_applies`. Returns the views q [T, H, D], k, v [T, KVH, D] of qkv."""
    T, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    cpu_kernels.rotary_and_write_kv_(qkv, cos_sin[0], cos_sin[1], kv_cache, slot_mapping, num_heads, num_kv_heads,
                                     head_dim)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim), v.view(T, num_kv_heads, head_dim)


def _apply_partial_rotary_qkv(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                              num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial rotary in torch, in place: the C++ rotary_neox_ rotates whole heads only.
    NOTE: bf16 rounding as HF (x1*cos and x2*sin each rounded, then their difference)."""
    T, rotary_dim = qkv.shape[0], 2 * cos_sin[0].shape[-1]
    heads = qkv.view(T, num_heads + 2 * num_kv_heads, head_dim)  # [T, H + 2*KVH, D]
    rot = heads[:, : num_heads + num_kv_heads, :rotary_dim]  # q and k heads' rotating dims [T, H + KVH, R]
    rot.copy_(apply_rotary(rot, cos_sin))
    return heads[:, :num_heads], heads[:, num_heads : num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads :]
