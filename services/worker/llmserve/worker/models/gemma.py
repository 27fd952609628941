"""Gemma (1): the shared decoder with three structural differences from Llama:
  - embeddings scaled by sqrt(hidden_size) (rounded to the model dtype, as HF does),
  - RMSNorm with a (1 + w) gain computed in float32 (OffsetRMSNorm),
  - GeGLU MLP (gelu, tanh approximation), tied LM head.
"""

from __future__ import annotations

from typing import Any

from llmserve.worker.layers.norm import OffsetRMSNorm
from llmserve.worker.models.decoder import DecoderForCausalLM


class GemmaForCausalLM(DecoderForCausalLM):
    norm_cls = OffsetRMSNorm

    @staticmethod
    def embed_scale(config: Any) -> float | None:
        return config.hidden_size**0.5
