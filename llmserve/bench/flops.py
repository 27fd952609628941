"""Model FLOPs and the machine's matmul peak, for MFU (model FLOP utilisation).

Achieved model FLOP/s counts only the work the model needs (vLLM/PaLM convention):
  2 x (parameters of the linear layers) per computed token
+ 2 x (LM head parameters) per token whose logits are computed (only sampled ones here)
+ 4 x heads x head_dim x layers per query-key pair attention scores (QK^T and AV).
It is divided by a matmul peak measured in the same process on the same dtype, so the
ratio needs no datasheet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelFlops:
    linear_params: int  # Per token, all layers: q, k, v, o, gate, up, down.
    lm_head_params: int
    attention_flops_per_pair: int

    @classmethod
    def from_config(cls, cfg) -> "ModelFlops":
        hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
        mlp = 3 * hidden * cfg.intermediate_size
        return cls(
            linear_params=layers * (attn + mlp),
            lm_head_params=hidden * cfg.vocab_size,
            attention_flops_per_pair=4 * heads * head_dim * layers,
        )

    def step_flops(self, computed_tokens: int, logits_tokens: int, attention_pairs: int) -> int:
        return (2 * self.linear_params * computed_tokens + 2 * self.lm_head_params * logits_tokens
                + self.attention_flops_per_pair * attention_pairs)


def measure_matmul_peak(dtype: torch.dtype = torch.float32, size: int = 2048, seconds: float = 1.5) -> float:
    """FLOP/s of a large square matmul on this machine, now (best of several runs)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # Warm-up.
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best
