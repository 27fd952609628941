"""Rotary position embedding, rotate-half (neox) layout as in HF Llama.

For x = [x1 | x2] (halves of head_dim) at position p:
  out = [x1*cos - x2*sin | x2*cos + x1*sin],  cos/sin = cos/sin(p * inv_freq)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.kernel_op import fused_cpu_applies


def rope_parameters(config: Any) -> dict:
    """transformers 5 keeps RoPE settings in `config.rope_parameters`; older configs use
    `rope_theta` + `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype | None = None):
        super().__init__()
        rope_type = params.get("rope_type", "default")
        base = float(params["rope_theta"])
        # NOTE: the tables are computed on the host in float32 whatever the device, so a
        # GPU rank's angles are bit-identical to a CPU rank's; then moved where the model lives.
        device = torch.empty(0).device
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: 'default', 'llama3')")
        # cos, sin: [max_position, head_dim // 2], computed in float32, stored in model dtype
        freqs = torch.arange(max_position, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None, :]
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("cos", freqs.cos().to(device, dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device, dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        """positions: [T] -> this step's angles, computed once per step and shared by every
        layer through `apply_rotary_qkv`. On CUDA the Triton kernel reads the tables at
        `positions` itself; elsewhere the rows are gathered here ([T, 1, D/2] each)."""
        if positions.is_cuda:
            return Rope(self.cos, self.sin, positions)
        return Rope(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class Rope(NamedTuple):
    """cos, sin: [T, 1, D/2], one row per token (positions None); or, on CUDA, the whole
    tables [max_position, D/2] and the token positions [T] that index them."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None = None


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D/2]
    cos, sin = cos_sin[0], cos_sin[1]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_qkv(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                     num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused projection output -> rotated q, k and v.

    qkv: [T, (H + 2*KVH) * D] laid out [q | k | v] -> q [T, H, D], k [T, KVH, D], v [T, KVH, D]
    (views of qkv). On CPU (C++) and CUDA (Triton) the q and k heads are rotated in
    place in one pass.
    """
    T = qkv.shape[0]
    cos, sin = cos_sin[0], cos_sin[1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    positions = cos_sin[2] if len(cos_sin) > 2 else None
    if positions is not None:  # CUDA: the Triton kernel rotates q and k in place in one launch
        from llmserve.kernels.triton import rotary_embedding

        q, k, v = (t.view(T, n, head_dim) for t, n in zip(qkv.split([q_size, kv_size, kv_size], dim=-1),
                                                          (num_heads, num_kv_heads, num_kv_heads)))
        rotary_embedding(positions, q, k, cos, sin, is_neox=True)
        return q, k, v
    if cos.dtype == qkv.dtype and fused_cpu_applies(qkv):
        cpu_kernels.rotary_neox_(qkv, cos.reshape(T, -1), sin.reshape(T, -1), num_heads + num_kv_heads, head_dim)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim), v.view(T, num_kv_heads, head_dim)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim)
    return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin), v.view(T, num_kv_heads, head_dim)
