"""Linear layers whose weight loaders narrow a full checkpoint tensor to this rank's shard.

With tp_size=1 every shard is the whole tensor. For tp_size>1:
  ColumnParallel   splits the output dim (weight rows):   W[out/tp, in]
  RowParallel      splits the input dim (weight columns):  W[out, in/tp], then all-reduce
  QKVParallel      splits q heads and kv heads separately (kv heads replicated when
                   num_kv_heads < tp_size)
  MergedColumn     splits each fused sub-matrix (gate, up) separately
A checkpoint tensor that is already fused (Phi-3's qkv_proj, gate_up_proj) arrives with
shard id None: it is cut into its full q/k/v (gate/up) parts, and each part is narrowed as
above, so a rank never takes a contiguous row range of the fused tensor.

Fused layout of QKVParallelLinear.weight (rows, on one rank):
  [ q: num_heads*head_dim | k: num_kv_heads*head_dim | v: num_kv_heads*head_dim ]

`quantization="int8"` (or "int8-weight-only"): `weight` is int8 [out, in] and the buffer
`weight_scale` [out] float32 (see int8_weight.py); where the W8A8 kernel runs, `weight`
is emptied after loading and the kernel's packed copy is the weight. Each weight loader
quantizes the rows of the shard this rank keeps as it stores them, one checkpoint tensor
at a time: the float weight is never held whole. Per-output-row scales make that exact:
a row's scale depends on that row alone (for RowParallel, on this rank's columns of it:
each rank scales its own partial product before the all-reduce).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.worker.distributed import SINGLE, GroupHandle
from llmserve.worker.layers.int8_weight import QUANTIZATIONS, Int8Weight, is_int8, quantize_rows, w8a8_applies
from llmserve.worker.layers.packed_weight import PackedWeight


def _divide(a: int, b: int, what: str = "") -> int:
    if a % b:
        what = what or "dimension"
        raise ValueError(f"{what} ({a}) must be divisible by tensor parallel size ({b})")
    return a // b


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shard {tuple(src.shape)} != parameter {tuple(dst.shape)}")
    dst.copy_(src)


class LinearBase(nn.Module):
    """y = x @ W.T (+ b). Parameters carry a `weight_loader` attribute used by the loader."""

    def __init__(self, out_features: int, in_features: int, bias: bool, tp: GroupHandle,
                 quantization: str = "none"):
        super().__init__()
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r} (choices: {', '.join(QUANTIZATIONS)})")
        self.tp = tp
        self.tp_size, self.tp_rank = tp.size, tp.rank
        self.quantization = quantization
        # weight: [out_features (this rank), in_features (this rank)], model dtype or int8
        weight_dtype = torch.int8 if is_int8(quantization) else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if is_int8(quantization):
            # weight_scale: [out_features] float32; a buffer, not a checkpoint entry.
            self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32), persistent=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        raise NotImplementedError

    def store(self, param: nn.Parameter, shard: torch.Tensor, what: str, offset: int | None = None) -> None:
        """Copy `shard` into `param` (into its rows [offset, offset + len(shard)) when
        `offset` is given), quantizing those rows when the weight is int8."""
        dst = param.data if offset is None else param.data.narrow(0, offset, shard.shape[0])
        if param is not self.weight or self.quantization == "none":
            _copy_checked(dst, shard, what)
            return
        q, scale = quantize_rows(shard)  # q: [rows, in] int8; scale: [rows]
        _copy_checked(dst, q, what)
        scales = self.weight_scale if offset is None else self.weight_scale.narrow(0, offset, shard.shape[0])
        scales.copy_(scale)

    packed: PackedWeight | None = None  # the CPU weight in its GEMM library's layout, else None
    int8: Int8Weight | None = None  # the int8 weight and its scales, with an int8 quantization

    def process_weights_after_loading(self) -> None:
        w = self.weight
        if self.packed is not None or self.int8 is not None:  # (already processed)
            return
        if is_int8(self.quantization):
            w8a8 = w8a8_applies(w.data, self.quantization)
            self.int8 = Int8Weight(w.data, self.weight_scale, quantize_activations=w8a8)
            if w8a8:  # held once: the packed copy is the weight
                w.data = torch.empty(0, dtype=w.dtype)
            return
        self.packed = PackedWeight.pack(w)
        if self.packed is not None:
            # The model is held once: `weight` becomes empty, the packed copy is the weight.
            w.data = torch.empty(0, dtype=w.dtype)
        elif w.device.type == "cpu" and w.is_contiguous():
            # NOTE: without packing, MKL runs GEMMs with few rows (decode) faster with the
            # weight stored [in, out] (x @ W.T then needs no transposed operand). `weight`
            # stays an [out, in] view of that storage, so F.linear is unchanged.
            w.data = w.data.t().contiguous().t()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.int8 is not None:
            return self.int8.matmul(x, bias)
        if self.packed is not None:
            return self.packed.matmul(x, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the full weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: GroupHandle = SINGLE,
                 quantization: str = "none"):
        super().__init__(output_size, input_size, bias, tp, quantization)

    def weight_loader(self, param, loaded, shard_id=None):
        self.store(param, loaded, "ReplicatedLinear")


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks; each rank returns its slice (no gather here)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: GroupHandle = SINGLE,
                 quantization: str = "none"):
        super().__init__(_divide(output_size, tp.size), input_size, bias, tp, quantization)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        self.store(param, loaded.narrow(0, self.tp_rank * size, size), "ColumnParallelLinear")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused along the output dim (gate_proj, up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp: GroupHandle = SINGLE,
                 quantization: str = "none"):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp, quantization)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # stored fused (Phi-3's gate_up_proj): [gate | up] rows of the whole model
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear: bad shard id {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        shard = loaded.narrow(0, self.tp_rank * size, size)
        self.store(param, shard, f"gate_up shard {shard_id}", offset)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; q heads split across ranks, kv heads split or replicated."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp: GroupHandle = SINGLE,
        quantization: str = "none",
    ):
        self.head_dim = head_dim
        self.total_sizes = [total_num_heads * head_dim, total_num_kv_heads * head_dim, total_num_kv_heads * head_dim]
        self.num_heads = _divide(total_num_heads, tp.size, "Total number of attention heads")
        if total_num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp.size, "Total number of KV heads")
            self.num_kv_replicas = 1
        else:  # NOTE: fewer kv heads than ranks: each kv head lives on tp_size/kv ranks.
            self.num_kv_heads = 1
            if tp.size % total_num_kv_heads:
                raise ValueError(f"tensor parallel size ({tp.size}) must be a multiple of the number "
                                 f"of KV heads ({total_num_kv_heads}) when it exceeds it")
            self.num_kv_replicas = tp.size // total_num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, out, hidden_size, bias, tp, quantization)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # stored fused (Phi-3's qkv_proj): [q | k | v] rows of the whole model
            for sid, part in zip("qkv", loaded.split(self.total_sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, rank = self.kv_size, self.tp_rank // self.num_kv_replicas
        else:
            raise ValueError(f"QKVParallelLinear: bad shard id {shard_id!r}")
        shard = loaded.narrow(0, rank * size, size)
        self.store(param, shard, f"qkv shard {shard_id}", offset)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # qkv: [T, q_size + 2*kv_size] -> q [T, q_size], k [T, kv_size], v [T, kv_size]
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; partial sums are all-reduced over the TP group."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: GroupHandle = SINGLE,
                 quantization: str = "none"):
        super().__init__(output_size, _divide(input_size, tp.size), bias, tp, quantization)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias: full on every rank, added once after the reduce
            _copy_checked(param.data, loaded, "RowParallelLinear bias")
            return
        size = param.shape[1]
        self.store(param, loaded.narrow(1, self.tp_rank * size, size), "RowParallelLinear")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial products (in place over the TP group)."""
        return self.tp.all_reduce(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in/tp] -> [T, out]
        y = self.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
