"""Qwen3-MoE: the Qwen3 block (QK-norm over head_dim on every q and k head, no q/k/v
bias) with a sparse mixture of experts on the layers the config makes sparse:

  sparse layer i:  i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
  router: softmax (float32) -> top-k -> renormalised only if norm_topk_prob; the weights
          rounded to the model dtype before they scale the experts (as transformers does)
  experts: num_experts of moe_intermediate_size; dense layers: intermediate_size.
Checkpoint names: mlp.gate, mlp.experts.E.gate_proj / up_proj / down_proj.
"""

from __future__ import annotations

from typing import Any

from llmserve.worker.models.moe import MoeDecoderForCausalLM


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    qk_norm = True

    @staticmethod
    def expert_intermediate_size(config: Any) -> int:
        return config.moe_intermediate_size

    def is_sparse_layer(self, config: Any, layer_idx: int) -> bool:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
                and (layer_idx + 1) % step == 0)
