"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama block (RMSNorm, SiLU-gated MLP, no biases). What
differs is in the checkpoint and the config, and the shared layers handle it:
  - q/k/v and gate/up stored already fused (`qkv_proj` [(H + 2*KVH) * D, hidden],
    `gate_up_proj` [2 * I, hidden]): the fused layers' weight loaders cut them into
    their parts, then into this rank's shards (linear.py);
  - LongRoPE scaling (`rope_type` "longrope", older "su") with short/long factors and an
    attention factor, and partial rotary (Phi-4-mini rotates 0.75 of each head): rotary.py.
"""

from __future__ import annotations

from llmserve.worker.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """Options as Llama's; the checkpoint's fused names are already our parameter names."""
