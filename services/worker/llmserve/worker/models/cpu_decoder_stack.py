"""A CPU step's decoder layers as one C++ call (llmserve_cpu::decoder_layers).

An eager step walks the layers in Python: ~9 ops a layer, each through the layers'
modules (norm, projections, rotary, attention backend) and torch's Python bindings. On a
CPU at small batches that walk is a large share of the step: on a 2-core AMD EPYC (Zen
5), SmolLM2-135M decode at batch 1 took 5.6 ms a step in int8 W8A8 and 9.0 ms in
bfloat16 eagerly, 3.9 and 6.5 ms with the C++ loop (one process, taking turns). The
loop runs the same ops in the same order (bit for bit the eager result), so what it
saves is the Python between them.

It takes the layers that are the plain pre-norm decoder (Llama, Mistral, Qwen2, Phi-3, SmolLM:
RMSNorm, rotary attention over the paged cache, SiLU-gated MLP, any projection layout
packed_weight.py / int8_weight.py choose except weight-only int8), one tensor-parallel
rank, and any step of decode and prefill rows whose prefill attention runs in the C++
flash kernel (TorchPagedAttention decides that; otherwise the step runs eagerly).
Anything else (q/k norms, sandwich norms, mixtures of experts, other activations) keeps
the eager layers. LLMSERVE_CPU_DECODER_STACK=0 turns it off (for comparison).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from llmserve.kernels import cpu as cpu_kernels
from llmserve.worker.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata
from llmserve.worker.layers.activation import SiluAndMul
from llmserve.worker.layers.linear import LinearBase, RowParallelLinear
from llmserve.worker.layers.norm import RMSNorm

log = logging.getLogger(__name__)

ENV = "LLMSERVE_CPU_DECODER_STACK"

# Projection kinds, as decoder_layers.cpp numbers them.
# TILES: our bfloat16 or float32 layout, by the dtype; TILES_SILU_MUL: a gate_up weight
# whose product also applies silu(gate) * up (PackedWeight.silu_mul).
W8A8, TILES, ONEDNN, MKL, DENSE, TILES_SILU_MUL = range(6)
_PACKED_KINDS = {"tiles": TILES, "onednn": ONEDNN, "mkl": MKL}
_EMPTY = torch.empty(0)


Projection = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]  # (kind, weight, extra, bias)


def _projection(linear: nn.Module, dtype: torch.dtype) -> Projection | str:
    """(kind, weight, extra, bias) of one projection for the C++ loop, or why it cannot go."""
    plain = (LinearBase.forward, RowParallelLinear.forward)
    if type(linear).matmul is not LinearBase.matmul or type(linear).forward not in plain:
        return f"{type(linear).__name__} projections"
    bias = linear.bias if linear.bias is not None else _EMPTY
    if linear.int8 is not None:
        if linear.int8.w8a8_packed is None:
            return "weight-only int8 projections"
        return W8A8, linear.int8.w8a8_packed, linear.int8.scale, bias
    if linear.packed is not None:
        kind = TILES_SILU_MUL if linear.packed.gate_up_interleaved else _PACKED_KINDS[linear.packed.kind]
        return kind, linear.packed.packed, linear.packed.shape_standin, bias
    if linear.weight.dtype != dtype:
        return f"a {linear.weight.dtype} weight under {dtype} activations"
    return DENSE, linear.weight, _EMPTY, bias


def _projections_of(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A layer's four projections, in decoder_layers' order."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _layer_refusal(layer: nn.Module) -> str | None:
    """Why a layer is not the plain pre-norm decoder the C++ loop runs (None: it is)."""
    from llmserve.worker.models.decoder import Attention, DecoderLayer, GatedMLP

    if type(layer) is not DecoderLayer:
        return f"{type(layer).__name__} layers"
    attn = layer.self_attn
    if type(attn) is not Attention:
        return f"{type(attn).__name__} attention"
    if type(layer.mlp) is not GatedMLP:
        return f"{type(layer.mlp).__name__} MLPs"
    if layer.pre_feedforward_layernorm is not None or attn.q_norm is not None:
        return "sandwich or q/k norms"
    if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
        return f"{type(layer.input_layernorm).__name__} norms"
    if type(layer.mlp.act) is not SiluAndMul:
        return f"the {type(layer.mlp.act).__name__} activation"
    if type(attn.attn) is not TorchPagedAttention:
        return f"the {type(attn.attn).__name__} attention backend"
    return None


class CpuDecoderStack:
    """The arguments of decoder_layers for one model's local layers, gathered once."""

    def __init__(self, layers: list[nn.Module], projections: list[Projection]):
        """projections: _projection's of every layer's four, in order (none refused)."""
        attn = layers[0].self_attn
        self.dtype, self.rope = layers[0].input_layernorm.weight.dtype, layers[0].rope
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps, self.scale, self.softcap = layers[0].input_layernorm.eps, attn.attn.scale, attn.attn.softcap or 0.0
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in layers]
        self.norms = [norm.weight for layer in layers
                      for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.kinds = [p[0] for p in projections]
        self.weights, self.extras, self.biases = ([p[i] for p in projections] for i in (1, 2, 3))
        self._caches_checked: list[torch.Tensor] | None = None
        # Prefill rows' attention in the C++ flash kernel, as the eager backend decides it
        # (else a step with prefill rows runs eagerly, through its SDPA fallback).
        self.prefill_in_kernel = attn.attn.prefill_kernel_applies(self.dtype, torch.device("cpu"))

    @classmethod
    def build(cls, model: nn.Module) -> CpuDecoderStack | None:
        """The stack for `model` (a DecoderModel), or None (logged why) where it does not apply."""
        layers = list(model.layers)[model.start : model.end]
        reason = cls._refusal(layers)
        if reason is None:
            dtype = layers[0].input_layernorm.weight.dtype
            projections = [_projection(p, dtype) for layer in layers for p in _projections_of(layer)]
            reason = next((p for p in projections if isinstance(p, str)), None)
        if reason is not None:
            log.info("CPU steps: the eager layers (%s)", reason)
            return None
        stack = cls(layers, projections)
        if stack.dtype == torch.float32:
            tiles = "float32 tiles (AVX-512)"
        else:
            tiles = "bfloat16 tiles (AMX)" if cpu_kernels.amx_supported() else "bfloat16 tiles (AVX-512)"
        names = sorted({["W8A8 int8", tiles, "oneDNN", "MKL", "dense", f"{tiles} with SiLU·mul"][k]
                        for k in stack.kinds})
        log.info("CPU steps: %d layers in one C++ call (%s products)", len(layers), ", ".join(names))
        return stack

    @staticmethod
    def _refusal(layers: list[nn.Module]) -> str | None:
        """Why these layers stay eager, their projections aside (None: nothing else)."""
        if os.environ.get(ENV, "1") == "0":
            return f"{ENV}=0"
        if not layers:
            return "no local layers"
        weight = layers[0].input_layernorm.weight if hasattr(layers[0], "input_layernorm") else None
        if weight is None or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return "not a float32 or bfloat16 model on the CPU"
        if not cpu_kernels.load():
            return "the CPU kernels are not built"
        for layer in layers:
            reason = _layer_refusal(layer)
            if reason is not None:
                return reason
            if layer.self_attn.qkv_proj.tp_size != 1:
                return "tensor parallelism"
        first = layers[0]
        if len({layer.rope for layer in layers}) != 1:
            return "RoPE tables per layer type"
        same = ("num_heads", "num_kv_heads", "head_dim")
        if any(getattr(layer.self_attn, a) != getattr(first.self_attn, a) for layer in layers for a in same):
            return "layers of different head counts"
        if any(layer.self_attn.attn.scale != first.self_attn.attn.scale or layer.self_attn.attn.softcap !=
               first.self_attn.attn.softcap or layer.input_layernorm.eps != first.input_layernorm.eps
               or layer.post_attention_layernorm.eps != first.input_layernorm.eps for layer in layers):
            return "layers of different attention scales, soft-caps or norm epsilons"
        if any(n.weight.dtype != weight.dtype for layer in layers
               for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return "norm weights in another dtype"
        return None

    def takes(self, hidden: torch.Tensor, rope: tuple, kv_caches: list[torch.Tensor], meta) -> bool:
        """Whether this step runs here: host cos/sin in the model's dtype (what the fused
        rotary + KV write takes), caches the kernels read in place, and any prefill rows'
        attention in the C++ flash kernel."""
        if not (isinstance(meta, TorchPagedMetadata) and hidden.shape[0] > 0 and hidden.dtype == self.dtype
                and (len(rope) == 2 or rope[2] is None) and rope[0].dtype == self.dtype):
            return False
        if kv_caches is not self._caches_checked:
            if not all(c.dtype == self.dtype and c.is_contiguous() and c.device.type == "cpu" for c in kv_caches):
                return False
            self._caches_checked = kv_caches
        return meta.num_decodes == hidden.shape[0] or self.prefill_in_kernel

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: tuple, kv_caches: list[torch.Tensor],
            meta: TorchPagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, E] (residual [T, E] or None) -> (hidden, residual) after every local layer."""
        return cpu_kernels.decoder_layers(hidden, residual, rope[0], rope[1], kv_caches, meta.slot_mapping,
                                          meta.num_decodes, meta.decode_block_table, meta.decode_seq_lens,
                                          meta.prefill_block_table, meta.prefill_query_start, meta.prefill_seq_lens,
                                          self.norms, self.weights, self.extras, self.biases, self.kinds, self.heads,
                                          self.kv_heads, self.head_dim, self.eps, self.scale, self.windows,
                                          self.softcap)
