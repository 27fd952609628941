"""Rotary position embedding, rotate-half (neox) layout as in HF Llama.

For x = [x1 | x2] (halves of head_dim) at position p:
  out = [x1*cos - x2*sin | x2*cos + x1*sin],  cos/sin = cos/sin(p * inv_freq)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.layers.fused_op import fused_cpu_applies


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
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: 'default', 'llama3')")
        # cos, sin: [max_position, head_dim // 2], computed in float32, stored in model dtype
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin), each [T, 1, D/2]; computed once per step, shared
        by every layer through `apply_rotary`."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D/2]
    cos, sin = cos_sin
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_qkv(qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], num_heads: int,
                     num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused projection output -> rotated q, k and v.

    qkv: [T, (H + 2*KVH) * D] laid out [q | k | v] -> q [T, H, D], k [T, KVH, D], v [T, KVH, D]
    (views of qkv). On CPU the q and k heads are rotated in place in one pass.
    """
    T = qkv.shape[0]
    cos, sin = cos_sin
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if cos.dtype == qkv.dtype and fused_cpu_applies(qkv):
        cpu_kernels.rotary_neox_(qkv, cos.reshape(T, -1), sin.reshape(T, -1), num_heads + num_kv_heads, head_dim)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim), v.view(T, num_kv_heads, head_dim)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim)
    return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin), v.view(T, num_kv_heads, head_dim)
