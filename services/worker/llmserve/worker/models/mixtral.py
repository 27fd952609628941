"""Mixtral: the Llama block with a sparse mixture of experts in every layer.

  router: softmax over all experts (float32) -> top-k -> renormalised (= a softmax over
          the k chosen logits); the weights stay float32 when they scale the experts.
  experts: SiLU-gated MLPs, `num_local_experts` of `intermediate_size` each.
Checkpoint names: block_sparse_moe.gate, block_sparse_moe.experts.E.w1 (gate) / w3 (up) /
w2 (down).
"""

from __future__ import annotations

from typing import Any

from llmserve.worker.models.moe import MoeDecoderForCausalLM


class MixtralForCausalLM(MoeDecoderForCausalLM):
    moe_module = "block_sparse_moe"
    renormalize_always = True
    round_weights = False

    @staticmethod
    def num_experts(config: Any) -> int:
        return config.num_local_experts
