"""Gemma 2 and Gemma 3 (text): Gemma's (1 + w) norms, scaled embeddings and GeGLU MLP
(gemma.py), plus
  - four norms per layer: on the attention output and around the MLP as well (sandwich),
  - attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5,
  - sliding-window layers where `layer_types` says sliding_attention (Gemma 2: every
    other layer; Gemma 3: five of every six), full attention on the others,
  - Gemma 2: attention scores soft-capped (c * tanh(s / c)), and the final logits too.
  - Gemma 3: QK-norm ((1 + w) RMSNorm over head_dim, before RoPE), one RoPE base for its
    sliding layers and another for its full ones (rope_tables). Its config carries
    attn_logit_softcapping, but HF's Gemma 3 attention does not apply it: nor do we.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llmserve.worker.models.decoder import LayerOptions
from llmserve.worker.models.gemma import GemmaForCausalLM


class Gemma2ForCausalLM(GemmaForCausalLM):
    sandwich_norms = True
    attention_softcap = True

    def layer_options(self, config: Any, layer_idx: int) -> LayerOptions:
        softcap = getattr(config, "attn_logit_softcapping", None) if self.attention_softcap else None
        return dataclasses.replace(super().layer_options(config, layer_idx),
                                   attn_scale=config.query_pre_attn_scalar**-0.5, attn_softcap=softcap)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    attention_softcap = False
