"""Qwen3: the Llama block plus QK-norm (an RMSNorm over head_dim on every q and k head,
before RoPE), no q/k/v bias. The blocks are shared (decoder.py); this file only picks
options. (Layers named in `layer_types` as sliding_attention get the config's window.)
"""

from __future__ import annotations

from llmserve.worker.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
