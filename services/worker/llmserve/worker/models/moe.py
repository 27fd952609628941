"""The sparse mixture-of-experts block shared by the MoE architectures (Mixtral,
Qwen3-MoE, OLMoE), and their common base: the shared decoder with this block in place of
the dense MLP on the layers the architecture names.

    hidden [T, H] -> gate (replicated linear) -> logits [T, E] -> select_experts
                  -> FusedMoE(hidden, weights [T, k], ids [T, k]) -> [T, H] (all-reduced)

Every rank computes the same logits (its input is the replicated hidden state), so every
rank routes each token alike and holds its slice of every expert.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.worker.distributed import GroupHandle
from llmserve.worker.layers.fused_moe import FusedMoE, RouterLinear, expert_weight_name, select_experts
from llmserve.worker.models.decoder import DecoderForCausalLM


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Any, tp: GroupHandle, num_experts: int, intermediate_size: int, renormalize: bool,
                 round_weights: bool):
        """round_weights: the routing weights are rounded to the model dtype before they scale
        the experts' outputs (Qwen3-MoE, OLMoE); else they stay float32 (Mixtral)."""
        super().__init__()
        self.top_k, self.renormalize, self.round_weights = config.num_experts_per_tok, renormalize, round_weights
        # NOTE: under --quantization int8 the attention and dense layers quantize, the router
        # and the experts stay in the model dtype (a changed router logit changes which
        # experts run, not only by how much; the experts have no int8 path yet).
        self.gate = RouterLinear(config.hidden_size, num_experts, bias=False, tp=tp)
        self.experts = FusedMoE(num_experts, config.hidden_size, intermediate_size, config.hidden_act, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        logits = self.gate(x)  # [T, E]
        weights_dtype = x.dtype if self.round_weights else torch.float32
        weights, ids = select_experts(logits, self.top_k, self.renormalize, weights_dtype)  # [T, k] each
        return self.experts(x, weights, ids)


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """Subclasses say which layers are sparse (`is_sparse_layer`), how the router weighs
    experts, and the checkpoint's name of the block (`moe_module`)."""

    moe_module = "mlp"  # the block's name in checkpoints (Mixtral: block_sparse_moe); ours is `mlp`
    renormalize_always = False  # Mixtral: the top-k weights always sum to 1
    round_weights = True

    @staticmethod
    def num_experts(config: Any) -> int:
        return config.num_experts

    @staticmethod
    def expert_intermediate_size(config: Any) -> int:
        return config.intermediate_size

    def is_sparse_layer(self, config: Any, layer_idx: int) -> bool:
        return True

    def mlp_for_layer(self, config: Any, layer_idx: int, tp: GroupHandle, quantization: str) -> nn.Module | None:
        if not self.is_sparse_layer(config, layer_idx):
            return None  # the dense GatedMLP
        renormalize = self.renormalize_always or bool(getattr(config, "norm_topk_prob", False))
        return SparseMoeBlock(config, tp, self.num_experts(config), self.expert_intermediate_size(config),
                              renormalize, self.round_weights)

    def remap_weight_name(self, name: str) -> tuple[str, Any] | None:
        """(parameter, shard id) of an expert weight or a renamed block's tensor; None: the
        packed_modules_mapping applies."""
        renamed = name.replace(f".{self.moe_module}.", ".mlp.") if self.moe_module != "mlp" else name
        expert = expert_weight_name(renamed)
        if expert is not None:
            return expert
        return (renamed, None) if renamed != name else None
