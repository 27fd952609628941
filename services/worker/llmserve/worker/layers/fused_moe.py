"""Mixture of experts: the top-k router and the experts' gated MLPs as one layer.

    x [T, H] -> router logits [T, E] -> softmax (float32) -> top-k -> (renormalise)
             -> weights [T, k], expert ids [T, k]
             -> sum_j weights[:, j] * down_e(silu(gate_e(x)) * up_e(x)),  e = ids[:, j]

Every expert's weights live in two stacked parameters, so the experts run as grouped
GEMMs over the tokens routed to them (never a loop over tokens):
  w13_weight: [E, 2 * I/tp, H]  gate rows | up rows (this rank's slice of each)
  w2_weight:  [E, H, I/tp]      this rank's columns of each down projection
Tensor parallelism splits every expert's intermediate size (gate/up by rows, down by
columns, as MergedColumn/RowParallelLinear do): each rank computes a partial sum of
every routed token's output, and one all-reduce after the weighted sum adds them.

CUDA: the Triton grouped-GEMM kernels (llmserve.kernels.triton.fused_moe). CPU: the
(token, expert) pairs sorted by expert, then a loop over the experts that were chosen,
each multiplying all of its rows at once through its weights packed at load in the
layout the dense layers use (packed_weight.py). NOTE: torch's F.grouped_mm (one call for
all experts) measured slower on the CPU at decode sizes: gate_up of 8 experts, hidden 512,
intermediate 384, 16 tokens top-2, AMD EPYC 2 threads: bfloat16 489 us vs the loop's 248,
float32 1267 vs 667.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.worker.distributed import SINGLE, GroupHandle
from llmserve.worker.layers.activation import gated_activation
from llmserve.worker.layers.linear import ReplicatedLinear
from llmserve.worker.layers.packed_weight import PackedWeight

# Checkpoint names of expert weights: one tensor per expert and projection (Mixtral's
# w1/w3/w2, Qwen3-MoE's and OLMoE's gate/up/down_proj), or the stacked 3-D tensors of
# transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
# [E, H, I]).
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(\.weight)?$")
_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def expert_weight_name(ckpt_name: str) -> tuple[str, tuple[int | None, str]] | None:
    """(parameter name, shard id) for an expert tensor of a checkpoint, else None. The shard
    id is (expert, "gate" | "up" | "down"), or (None, "gate_up" | "down") for a stacked one."""
    m = _PER_EXPERT.match(ckpt_name)
    if m and m["proj"] in _PARTS:
        part = _PARTS[m["proj"]]
        return f"{m['prefix']}.{'w2' if part == 'down' else 'w13'}_weight", (int(m["expert"]), part)
    m = _STACKED.match(ckpt_name)
    if m:
        part = "gate_up" if m["proj"] == "gate_up_proj" else "down"
        return f"{m['prefix']}.{'w2' if part == 'down' else 'w13'}_weight", (None, part)
    return None


class RouterLinear(ReplicatedLinear):
    """The router: logits [T, E] = x @ W.T with W [E, H] whole on every rank. NOTE: kept
    dense (no packing at load): with a few dozen rows a packed GEMM's fixed cost dominates
    (E=8, H=512, one token: F.linear 2.1 us, the packed one 13.3 us on an AMD EPYC), and
    F.linear's logits are transformers' own, so near-ties route alike."""

    def process_weights_after_loading(self) -> None:
        pass


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, top_k] in weights_dtype, expert ids [T, top_k] int64).
    Softmax over all experts in float32, then the top k; `renormalize` rescales those k to
    sum to 1 (the same as a softmax over the k logits: Mixtral; Qwen3-MoE and OLMoE when
    config.norm_topk_prob). NOTE: Mixtral keeps the weights in float32 and Qwen3-MoE/OLMoE
    round them to the model dtype first (weights_dtype), as transformers does."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


def _grouped_linear(x: torch.Tensor, weights: torch.Tensor | list[PackedWeight], groups: list[tuple[int, int]],
                    out_features: int) -> torch.Tensor:
    """x: [P, in] rows sorted by expert; groups: (expert, rows) of each chosen expert in that
    order; weights: [E, out, in] or E packed ones -> [P, out]: one GEMM per chosen expert."""
    out = x.new_empty(x.shape[0], out_features)
    start = 0
    for e, n in groups:
        w, rows = weights[e], x[start : start + n]
        out[start : start + n] = w.matmul(rows) if isinstance(w, PackedWeight) else F.linear(rows, w)
        start += n
    return out


class FusedMoE(nn.Module):
    """num_experts gated MLPs (hidden -> intermediate -> hidden); forward takes the router's
    choice. Weight loaders narrow each checkpoint tensor to this rank's slice."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 tp: GroupHandle = SINGLE):
        super().__init__()
        if intermediate_size % tp.size:
            raise ValueError(f"expert intermediate size ({intermediate_size}) must be divisible by tensor "
                             f"parallel size ({tp.size})")
        self.tp, self.num_experts = tp, num_experts
        self.local_intermediate = I = intermediate_size // tp.size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * I, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, I), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.act = gated_activation(hidden_act)
        self.packed: tuple[list[PackedWeight], list[PackedWeight]] | None = None  # CPU: (w13, w2) per expert
        self._loaded: set[tuple[int, str]] = set()  # (expert, gate | up | down) stored

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        """shard_id (expert_weight_name): (e, "gate" | "up") loaded [I, H] or (e, "down")
        [H, I]; (None, "gate_up") [E, 2I, H] or (None, "down") [E, H, I]."""
        expert, part = shard_id
        I, r = self.local_intermediate, self.tp.rank
        if part == "down":  # columns r*I .. (r+1)*I of each down projection
            dst, src = param.data, loaded.narrow(-1, r * I, I)
            dst = dst if expert is None else dst[expert]
            self._copy(dst, src, shard_id)
        elif part == "gate_up":  # [E, 2I_full, H]: gate rows, then up rows
            full = loaded.shape[1] // 2
            for j, offset in enumerate((0, full)):
                self._copy(param.data[:, j * I : (j + 1) * I], loaded[:, offset + r * I : offset + (r + 1) * I],
                           shard_id)
        elif part in ("gate", "up"):
            j = 0 if part == "gate" else 1
            self._copy(param.data[expert, j * I : (j + 1) * I], loaded.narrow(0, r * I, I), shard_id)
        else:
            raise ValueError(f"FusedMoE: bad shard id {shard_id!r}")
        experts = range(self.num_experts) if expert is None else [expert]
        parts = ("gate", "up") if part == "gate_up" else (part,)
        self._loaded |= {(e, p) for e in experts for p in parts}

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, shard_id: Any) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"expert weight {shard_id}: checkpoint shard {tuple(src.shape)} != "
                             f"parameter {tuple(dst.shape)}")
        dst.copy_(src)

    def process_weights_after_loading(self) -> None:
        """Every expert's gate, up and down must have arrived (the loader checks whole
        tensors only); on the CPU each expert's two matrices are then packed."""
        want = {(e, p) for e in range(self.num_experts) for p in ("gate", "up", "down")}
        if self._loaded and self._loaded != want:
            missing = [f"expert {e} {p}" for e, p in sorted(want - self._loaded)]
            raise ValueError(f"weights missing from checkpoint: {missing[:10]}")
        if self.packed is not None or self.w13_weight.device.type != "cpu":
            return
        w13 = [PackedWeight.pack(w) for w in self.w13_weight.data]
        w2 = [PackedWeight.pack(w) for w in self.w2_weight.data]
        if all(w is not None for w in w13 + w2):
            self.packed = (w13, w2)
            # The model is held once: the stacked weights are emptied, the packed copies are the weights.
            self.w13_weight.data = torch.empty(0, dtype=self.w13_weight.dtype)
            self.w2_weight.data = torch.empty(0, dtype=self.w2_weight.dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; topk_weights: [T, k]; topk_ids: [T, k] -> [T, H] (summed over the TP group)."""
        if x.is_cuda:
            from llmserve.kernels.triton import fused_moe

            out = fused_moe(x.contiguous(), self.w13_weight, self.w2_weight, topk_weights.contiguous(), topk_ids,
                            activation=self.act)
        else:
            out = self.forward_grouped(x, topk_weights, topk_ids)
        return self.tp.all_reduce(out)

    def forward_grouped(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The torch path: (token, expert) pairs sorted by expert, each chosen expert's two
        GEMMs over all of its rows, the weighted rows summed per token (this rank's partial sum)."""
        T, k = topk_ids.shape
        # pair p = (token p // k, its slot p % k); order: [P = T*k] the pairs grouped by expert
        by_expert, order = topk_ids.flatten().sort(stable=True)
        experts, counts = torch.unique_consecutive(by_expert, return_counts=True)  # the chosen experts, rows of each
        groups = list(zip(experts.tolist(), counts.tolist()))
        w13, w2 = self.packed if self.packed is not None else (self.w13_weight, self.w2_weight)
        xs = x.index_select(0, order // k)  # [P, H] each pair's token, grouped by expert
        h = self.act(_grouped_linear(xs, w13, groups, 2 * self.local_intermediate))  # [P, I/tp]
        ys = _grouped_linear(h, w2, groups, x.shape[1])  # [P, H]
        y = torch.empty_like(ys).index_copy_(0, order, ys).view(T, k, -1)  # [T, k, H] back in pair order
        # NOTE: the product promotes to float32 with float32 weights (Mixtral) and stays in
        # the model dtype with rounded ones (Qwen3-MoE): the k rows then sum as transformers does.
        return (y * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
