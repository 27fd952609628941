"""Shared decoder blocks: attention, gated MLP, pre-norm layer, and a pipeline-aware
stack. Architecture files (llama.py, gemma.py) only choose options.

Tensor parallelism lives in the layers (each takes the TP group); pipeline parallelism
lives here: a stage builds only its own layers [start, end), the first stage the
embedding, the last the final norm and LM head. Other layers are `MissingLayer`
placeholders so parameter names keep their checkpoint indices.

    stage 0:  ids -> embed -> layers[0:k]   -> (hidden, residual) --send-->
    stage 1:            (hidden, residual) -> layers[k:L] -> norm -> hidden -> LM head
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from llmserve.worker.attention import AttentionMetadata, TorchPagedAttention
from llmserve.worker.distributed import GroupHandle, ParallelState
from llmserve.worker.layers.activation import gated_activation
from llmserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmserve.worker.layers.norm import RMSNorm
from llmserve.worker.layers.rotary import RotaryEmbedding, apply_rotary_qkv, rope_parameters

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_tensor_parallel(config: Any, tp_size: int) -> None:
    """Clear errors before anything is built or loaded."""
    for what, n in (("attention heads", config.num_attention_heads),
                    ("KV heads", config.num_key_value_heads)):
        if n >= tp_size and n % tp_size:
            raise ValueError(f"Total number of {what} ({n}) must be divisible by tensor parallel size ({tp_size})")
    if config.num_key_value_heads < tp_size and tp_size % config.num_key_value_heads:
        raise ValueError(f"tensor parallel size ({tp_size}) must be a multiple of the number of KV heads "
                         f"({config.num_key_value_heads}) when it exceeds it")


def local_kv_heads(config: Any, tp_size: int) -> int:
    """KV heads cached on one TP rank (1 when heads are replicated across ranks)."""
    return max(1, config.num_key_value_heads // tp_size)


class Attention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, tp: GroupHandle, quantization: str = "none"):
        super().__init__()
        D = head_dim_of(config)
        bias = qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, D, config.num_attention_heads, config.num_key_value_heads, bias, tp, quantization
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, D
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * D, config.hidden_size, getattr(config, "attention_bias", False), tp,
            quantization
        )
        self.attn = TorchPagedAttention(self.num_heads, D, self.num_kv_heads)

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        # hidden: [T, hidden_size]; rope: (cos, sin) for this step's positions
        T = hidden.shape[0]
        # q: [T, H/tp, D]; k, v: [T, KVH/tp, D]
        q, k, v = apply_rotary_qkv(self.qkv_proj(hidden), rope, self.num_heads, self.num_kv_heads, self.head_dim)
        o = self.attn.forward(q, k, v, kv_cache, meta)  # [T, H/tp, D]
        return self.o_proj(o.view(T, -1))  # all-reduce #1 of the layer


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, config: Any, tp: GroupHandle, quantization: str = "none"):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        I = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [I, I], bias, tp, quantization)
        self.act = gated_activation(config.hidden_act)
        self.down_proj = RowParallelLinear(I, config.hidden_size, bias, tp, quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # all-reduce #2 of the layer


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, norm_cls: type[RMSNorm], tp: GroupHandle,
                 quantization: str = "none"):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, tp, quantization)
        self.mlp = GatedMLP(config, tp, quantization)
        self.input_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """Placeholder for a layer held by another pipeline stage (no parameters)."""


class DecoderModel(nn.Module):
    def __init__(self, config: Any, parallel: ParallelState, qkv_bias: bool, norm_cls: type[RMSNorm],
                 embed_scale: float | None, quantization: str = "none"):
        super().__init__()
        tp = parallel.tp
        self.start, self.end = parallel.stage_layers(config.num_hidden_layers)
        self.is_first, self.is_last = parallel.is_first_stage, parallel.is_last_stage
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if self.is_first else None
        self.embed_scale = embed_scale
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, norm_cls, tp, quantization) if self.start <= i < self.end else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps) if self.is_last else None
        # NOTE: one cos/sin cache for all layers, gathered once per step.
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None):
        """First stage: input_ids [T]; later stages: intermediate = (hidden, residual) [T, H].
        kv_caches: one per local layer. Returns hidden [T, H] (last stage, after the final
        norm) or (hidden, residual) for the next stage."""
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
            if self.embed_scale is not None:  # NOTE: scale rounded to the model dtype, as HF does
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb(positions)
        for layer, kv_cache in zip(self.layers[self.start : self.end], kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        if not self.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Base of the architecture classes; subclasses set the options below."""

    qkv_bias = False
    norm_cls: type[RMSNorm] = RMSNorm
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def embed_scale(config: Any) -> float | None:
        return None

    def __init__(self, config: Any, parallel: ParallelState | None = None, quantization: str = "none"):
        """`quantization="int8"` / "int8-weight-only": the layers' projections (qkv, o,
        gate/up, down) hold int8 weights (int8_weight.py). The LM head multiplies by an int8
        copy only under W8A8 (see ParallelLMHead: torch's weight-only kernel is slower than
        the bfloat16 head). NOTE: the embedding and the norms stay in the model dtype: the
        embedding is a row lookup (no matmul to speed up; a tied head's int8 copy leaves
        the inputs unchanged), the norms are a few vectors."""
        super().__init__()
        parallel = parallel or ParallelState()
        check_tensor_parallel(config, parallel.tp.size)
        self.config, self.parallel, self.quantization = config, parallel, quantization
        self.model = DecoderModel(config, parallel, self.qkv_bias, self.norm_cls, self.embed_scale(config),
                                  quantization)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if parallel.is_last_stage:
            tied_to = self.model.embed_tokens if self.tied else None  # None on later stages: own copy
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel.tp, tied_to=tied_to,
                                          quantization=quantization)

    @property
    def num_local_layers(self) -> int:
        return self.model.end - self.model.start

    def local_weight_name(self, ckpt_name: str) -> str | None:
        """The parameter a checkpoint tensor loads into on this rank, or None when another
        pipeline stage holds it (the loader then skips reading it)."""
        m = _LAYER_INDEX.match(ckpt_name)
        if m:
            return ckpt_name if self.model.start <= int(m.group(1)) < self.model.end else None
        if ckpt_name.startswith("model.embed_tokens."):
            if self.model.is_first:
                return ckpt_name
            # Tied head on a later stage: the embedding matrix is the head's weight.
            return ckpt_name.replace("model.embed_tokens.", "lm_head.") if self.tied and self.model.is_last else None
        if ckpt_name.startswith("model.norm."):
            return ckpt_name if self.model.is_last else None
        if ckpt_name.startswith("lm_head."):
            return None if self.tied or not self.model.is_last else ckpt_name
        return ckpt_name

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, intermediate=None):
        """input_ids, positions: [T] -> hidden: [T, hidden] (or (hidden, residual) mid-pipeline)"""
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] (sampled positions only) -> logits [S, vocab] (last stage only;
        collective over the TP group)."""
        return self.lm_head(hidden)
