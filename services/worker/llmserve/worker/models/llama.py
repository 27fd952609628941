"""Llama-family decoders (Llama 2/3, SmolLM2, Mistral-style; Qwen2 = Llama + q/k/v bias).

Flattened tokens in, hidden states out:
  input_ids [T], positions [T], kv_caches[num_local_layers], meta -> hidden [T, hidden]
The blocks are shared (decoder.py); this file only picks options.
"""

from __future__ import annotations

from llmserve.worker.models.decoder import DecoderForCausalLM, head_dim_of

__all__ = ["LlamaForCausalLM", "Qwen2ForCausalLM", "head_dim_of"]


class LlamaForCausalLM(DecoderForCausalLM):
    """RMSNorm (w * x), SiLU-gated MLP, RoPE, optional tied head."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama block with biases on q/k/v."""

    qkv_bias = True
