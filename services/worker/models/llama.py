"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral-style; Qwen2 = Llama + q/k/v bias).

Flattened tokens in, hidden states out:
  input_ids [T], positions [T], kv_caches[num_layers], meta -> hidden [T, hidden]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.worker.attention import AttentionMetadata, TorchPagedAttention
from llmserve.worker.layers.activation import SiluAndMul
from llmserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmserve.worker.layers.norm import RMSNorm
from llmserve.worker.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        D = head_dim_of(config)
        bias = qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, D, config.num_attention_heads, config.num_key_value_heads, bias, tp_size, tp_rank
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, D
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * D, config.hidden_size,
            getattr(config, "attention_bias", False), tp_size, tp_rank,
        )
        self.attn = TorchPagedAttention(self.num_heads, D, self.num_kv_heads)

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        # hidden: [T, hidden_size]; rope: (cos, sin) for this step's positions
        T = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        o = self.attn.forward(q, k, v, kv_cache, meta)  # [T, H, D]
        return self.o_proj(o.view(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only 'silu')")
        bias = getattr(config, "mlp_bias", False)
        I = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [I, I], bias, tp_size, tp_rank)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(I, config.hidden_size, bias, tp_size, tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, tp_size, tp_rank)
        self.mlp = LlamaMLP(config, tp_size, tp_rank)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_size, tp_rank)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, tp_size, tp_rank) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # NOTE: one cos/sin cache for all layers, gathered once per step.
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        rope = self.rotary_emb(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qkv_bias, tp_size, tp_rank)
        tied = self.model.embed_tokens if getattr(config, "tie_word_embeddings", False) else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_size, tp_rank, tied_to=tied)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden: [T, hidden]"""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] (sampled positions only) -> logits [S, vocab]"""
        return self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama block with biases on q/k/v."""

    qkv_bias = True
