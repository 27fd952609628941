"""OLMoE: the Llama block with a sparse mixture of experts in every layer, and q/k norms
over the whole q and k projections (not per head, unlike Qwen3), before RoPE; with
config.clip_qkv, q, k and v are then clamped to [-clip, clip].

  router: softmax (float32) -> top-k -> renormalised only if norm_topk_prob; the weights
          rounded to the model dtype before they scale the experts (as transformers does)
  experts: num_experts SiLU-gated MLPs of intermediate_size
Checkpoint names: self_attn.q_norm [H*D], self_attn.k_norm [KVH*D], mlp.gate,
mlp.experts.E.gate_proj / up_proj / down_proj.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.worker.distributed import GroupHandle, ParallelState
from llmserve.worker.layers.norm import ShardedRMSNorm
from llmserve.worker.models.decoder import Attention
from llmserve.worker.models.moe import MoeDecoderForCausalLM


class FullWidthQKNormAttention(nn.Module):
    """The shared Attention's projections and paged attention, with the q and k
    projections normed whole (ShardedRMSNorm: each TP rank holds its heads' columns)."""

    def __init__(self, base: Attention, config: Any, tp: GroupHandle):
        super().__init__()
        self.qkv_proj, self.o_proj, self.attn = base.qkv_proj, base.o_proj, base.attn
        self.num_heads, self.num_kv_heads, self.head_dim = base.num_heads, base.num_kv_heads, base.head_dim
        D, eps, kv = self.head_dim, config.rms_norm_eps, self.qkv_proj
        self.q_norm = ShardedRMSNorm(config.num_attention_heads * D, self.num_heads * D, eps, tp, tp.rank)
        self.k_norm = ShardedRMSNorm(config.num_key_value_heads * D, self.num_kv_heads * D, eps, tp,
                                     tp.rank // kv.num_kv_replicas, kv.num_kv_replicas)
        self.clip = getattr(config, "clip_qkv", None)

    # The shared forward (project -> RoPE, cache write, attention -> o_proj) around this project.
    forward = Attention.forward

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> qkv [T, (H + 2*KVH)/tp * D], q and k normed whole
        (and all three clipped with clip_qkv)."""
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]  # strided views, normed in place
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))
        if self.clip is not None:
            qkv.clamp_(-self.clip, self.clip)
        return qkv


class OlmoeForCausalLM(MoeDecoderForCausalLM):
    def __init__(self, config: Any, parallel: ParallelState | None = None, quantization: str = "none"):
        super().__init__(config, parallel, quantization)
        for layer in self.model.layers[self.model.start : self.model.end]:
            layer.self_attn = FullWidthQKNormAttention(layer.self_attn, config, self.parallel.tp)
