"""Shared decoder blocks: attention, gated MLP, pre-norm layer, and a pipeline-aware
stack. Architecture files (llama.py, gemma.py) only choose options.

Tensor parallelism lives in the layers (each takes the TP group); pipeline parallelism
lives here: a stage builds only its own layers [start, end), the first stage the
embedding, the last the final norm and LM head. Other layers are `MissingLayer`
placeholders so parameter names keep their checkpoint indices.

    stage 0:  ids -> embed -> layers[0:k]   -> (hidden, residual) --send-->
    stage 1:            (hidden, residual) -> layers[k:L] -> norm -> hidden -> LM head
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable

import torch
from torch import nn

from llmserve.worker.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from llmserve.worker.distributed import GroupHandle, ParallelState
from llmserve.worker.layers.activation import SiluAndMul, gated_activation
from llmserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmserve.worker.layers.norm import RMSNorm
from llmserve.worker.layers.rotary import (Rope, RotaryEmbedding, apply_rotary_qkv, apply_rotary_qkv_and_write_kv,
                                           rope_parameters, rotary_kv_write_applies)
from llmserve.worker.models.cpu_decoder_stack import CpuDecoderStack

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_tensor_parallel(config: Any, tp_size: int) -> None:
    """Clear errors before anything is built or loaded."""
    for what, n in (("attention heads", config.num_attention_heads),
                    ("KV heads", config.num_key_value_heads)):
        if n >= tp_size and n % tp_size:
            raise ValueError(f"Total number of {what} ({n}) must be divisible by tensor parallel size ({tp_size})")
    if config.num_key_value_heads < tp_size and tp_size % config.num_key_value_heads:
        raise ValueError(f"tensor parallel size ({tp_size}) must be a multiple of the number of KV heads "
                         f"({config.num_key_value_heads}) when it exceeds it")


def local_kv_heads(config: Any, tp_size: int) -> int:
    """KV heads cached on one TP rank (1 when heads are replicated across ranks)."""
    return max(1, config.num_key_value_heads // tp_size)


def sliding_windows(config: Any) -> list[int | None]:
    """Each layer's attention window (None = full attention), as HF decides it:
    `layer_types` names the windowed layers where the config has it (Gemma 2/3, Qwen2/3
    with use_sliding_window); without it (Mistral) a set `sliding_window` windows every
    layer."""
    window, n = getattr(config, "sliding_window", None), config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * n
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(config, "use_sliding_window", None) is False:
        return [None] * n
    return [window] * n


def release_window(config: Any) -> int:
    """How far back any layer reads keys when every layer has a window (the largest):
    the scheduler releases blocks older than that. 0 when some layer sees every token."""
    windows = sliding_windows(config)
    return max(windows) if windows and all(windows) else 0


def rope_tables(config: Any) -> dict[str, dict]:
    """RoPE settings per table: {"default": ...}, or one per layer type where the config
    keeps them so (Gemma 3: a local base for its sliding layers, another for full ones)."""
    params = getattr(config, "rope_parameters", None) or {}
    types = set(getattr(config, "layer_types", None) or ())
    if types and all(isinstance(params.get(t), dict) for t in types):
        return {t: rope_parameters(_WithRope(config, params[t])) for t in sorted(types)}
    return {"default": rope_parameters(config)}


class _WithRope:
    """`config` seen with one layer type's RoPE settings (for rope_parameters)."""

    def __init__(self, config: Any, params: dict):
        self._config, self.rope_parameters = config, params

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


@dataclass(frozen=True)
class LayerOptions:
    """What an architecture chooses for one layer (DecoderForCausalLM.layer_options)."""

    sliding_window: int | None = None  # attend to the last W keys only
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores -> c * tanh(scores / c)
    qk_norm: bool = False  # an RMSNorm over head_dim on each q and k head, before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms on the attention output and around the MLP too (Gemma 2/3)
    rope: str = "default"  # which of rope_tables(config) the layer rotates with


def rotary_attention(attn: AttentionBackend, qkv: torch.Tensor, rope: Rope, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """RoPE on the q and k heads of qkv [T, (H + 2*KVH) * D], k and v stored in kv_cache,
    attention -> [T, H, D]. On CPU one C++ pass rotates and stores (the backend is told
    the keys are in place); elsewhere the backend stores them."""
    if rotary_kv_write_applies(qkv, rope, kv_cache):
        q, k, v = apply_rotary_qkv_and_write_kv(qkv, rope, num_heads, num_kv_heads, head_dim, kv_cache,
                                                meta.slot_mapping)
        return attn.forward(q, k, v, kv_cache, meta, kv_stored=True)
    # q: [T, H, D]; k, v: [T, KVH, D]
    q, k, v = apply_rotary_qkv(qkv, rope, num_heads, num_kv_heads, head_dim)
    return attn.forward(q, k, v, kv_cache, meta)


class Attention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, tp: GroupHandle, quantization: str = "none",
                 options: LayerOptions = LayerOptions(), norm_cls: type[RMSNorm] = RMSNorm):
        super().__init__()
        D = head_dim_of(config)
        bias = qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, D, config.num_attention_heads, config.num_key_value_heads, bias, tp, quantization
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, D
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * D, config.hidden_size, getattr(config, "attention_bias", False), tp,
            quantization
        )
        self.attn = TorchPagedAttention(self.num_heads, D, self.num_kv_heads, options.attn_scale,
                                        options.sliding_window, options.attn_softcap)
        self.q_norm = norm_cls(D, config.rms_norm_eps) if options.qk_norm else None
        self.k_norm = norm_cls(D, config.rms_norm_eps) if options.qk_norm else None

    def forward(self, rope, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        # hidden: [T, hidden_size]; rope: (cos, sin) for this step's positions
        T = hidden.shape[0]
        o = rotary_attention(self.attn, self.project(hidden), rope, kv_cache, meta, self.num_heads,
                             self.num_kv_heads, self.head_dim)  # [T, H/tp, D]
        return self.o_proj.forward(o.view(T, -1))  # all-reduce #1 of the layer

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] -> qkv [T, (H + 2*KVH)/tp * D], q and k heads normed
        where the layer has qk norms: everything of attention before RoPE."""
        qkv = self.qkv_proj.forward(hidden)
        if self.q_norm is not None:
            self._qk_norm_(qkv)
        return qkv

    def _qk_norm_(self, qkv: torch.Tensor) -> None:
        """Each q and k head normed over head_dim, written back into qkv: RoPE comes
        after it, and the fused rotary kernels rotate the projection output in place."""
        T, D = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * D, self.num_kv_heads * D
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]  # [T, H*D], [T, KVH*D] (strided views)
        q.copy_(self.q_norm(q.reshape(T * self.num_heads, D)).view(T, q_size))
        k.copy_(self.k_norm(k.reshape(T * self.num_kv_heads, D)).view(T, kv_size))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

    def __init__(self, config: Any, tp: GroupHandle, quantization: str = "none"):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        I = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [I, I], bias, tp, quantization)
        # (Gemma 2/3 configs name it hidden_activation; their hidden_act may be None)
        self.act = gated_activation(getattr(config, "hidden_act", None) or config.hidden_activation)
        self.down_proj = RowParallelLinear(I, config.hidden_size, bias, tp, quantization)

    def process_weights_after_loading(self) -> None:
        """On AMX, a SiLU gate's merged gate/up weight in bfloat16 tiles is reordered so
        that one product gives silu(gate) * up (PackedWeight.silu_mul): the [T, 2I]
        intermediate and silu_and_mul's pass over it are gone, the result bit for bit
        the same. (The loader calls this before the projections' own hooks: it packs
        gate_up first.)"""
        gate_up = self.gate_up_proj
        gate_up.process_weights_after_loading()
        packed = gate_up.packed
        if (packed is not None and type(self.act) is SiluAndMul and gate_up.bias is None
                and not packed.gate_up_interleaved and packed.silu_mul_fits()):
            packed.interleave_gate_up()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.gate_up_proj.packed
        if packed is not None and packed.gate_up_interleaved:
            return self.down_proj.forward(packed.silu_mul(x))
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))  # all-reduce #2 of the layer


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, norm_cls: type[RMSNorm], tp: GroupHandle,
                 quantization: str = "none", mlp: nn.Module | None = None,
                 options: LayerOptions = LayerOptions()):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, tp, quantization, options, norm_cls)
        self.rope = options.rope
        # `mlp`: the architecture's block for this layer (a mixture of experts); None: the dense GatedMLP.
        self.mlp = mlp if mlp is not None else GatedMLP(config, tp, quantization)
        self.input_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if options.sandwich_norms:
            self.pre_feedforward_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        # hidden, residual: [T, hidden_size]; the residual stream is their sum (residual None: hidden)
        hidden, residual = self.begin(hidden, residual)
        return self.end(self.self_attn.forward(rope, hidden, kv_cache, meta), residual)

    # NOTE: begin / self_attn / end are the layer's halves around attention: the eager
    # forward above and the piecewise CUDA graphs (piecewise_graphs.py) both run them.
    def begin(self, hidden, residual):
        """The input norm: (normed hidden, residual stream) [T, hidden_size] each."""
        if residual is None:
            return self.input_layernorm.forward(hidden), hidden
        return self.input_layernorm.forward(hidden, residual)

    def end(self, hidden, residual):
        """After attention (hidden: o_proj's output): the post-attention norms and the MLP
        -> (hidden, residual) [T, hidden_size], the next layer's inputs."""
        if self.pre_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
            return self.mlp.forward(hidden), residual
        # Sandwich (Gemma 2/3): stream += norm(attn); then stream += norm(mlp(norm(stream)))
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class MissingLayer(nn.Module):
    """Placeholder for a layer held by another pipeline stage (no parameters)."""


class DecoderModel(nn.Module):
    def __init__(self, config: Any, parallel: ParallelState, qkv_bias: bool, norm_cls: type[RMSNorm],
                 embed_scale: float | None, quantization: str = "none",
                 mlp_for_layer: Callable[[int], nn.Module | None] = lambda i: None,
                 options_for_layer: Callable[[int], LayerOptions] = lambda i: LayerOptions()):
        super().__init__()
        tp = parallel.tp
        self.start, self.end = parallel.stage_layers(config.num_hidden_layers)
        self.is_first, self.is_last = parallel.is_first_stage, parallel.is_last_stage
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if self.is_first else None
        self.embed_scale = embed_scale
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, norm_cls, tp, quantization, mlp_for_layer(i), options_for_layer(i))
            if self.start <= i < self.end else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps) if self.is_last else None
        # A CPU step's layers as one C++ call (cpu_decoder_stack.py): set by the
        # runner once the weights are loaded and packed; None runs the layers eagerly.
        self.cpu_decoder_stack: CpuDecoderStack | None = None
        # NOTE: one cos/sin cache for all layers (one per layer type where RoPE differs by
        # type), gathered once per step.
        self.rotary = nn.ModuleDict({
            name: RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, params)
            for name, params in rope_tables(config).items()
        })

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> hidden [T, hidden_size] (first stage)."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # NOTE: scale rounded to the model dtype, as HF does
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden

    def ropes(self, positions: torch.Tensor) -> dict[str, Rope]:
        """This step's angles, per RoPE table: computed once, read by every layer."""
        return {name: emb(positions) for name, emb in self.rotary.items()}

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None):
        """First stage: input_ids [T]; later stages: intermediate = (hidden, residual) [T, H].
        kv_caches: one per local layer. Returns hidden [T, H] (last stage, after the final
        norm) or (hidden, residual) for the next stage."""
        if self.is_first:
            hidden, residual = self.embed(input_ids), None  # [T, hidden]
        else:
            hidden, residual = intermediate
        ropes = self.ropes(positions)
        # NOTE: islice, not self.layers[start:end]: a ModuleList slice builds a new
        # ModuleList every step (~90 us for 30 layers).
        # NOTE: here and in the layers' hot paths, module.forward(...), not module(...):
        # no hooks are ever set on them, and Module.__call__'s hook checks cost ~0.5 us a
        # call, ~300 calls a step (0.3 ms of the ~2 ms host path of a 30-layer step).
        stack = self.cpu_decoder_stack
        if stack is not None and stack.takes(hidden, rope := ropes[stack.rope], kv_caches, meta):
            hidden, residual = stack.run(hidden, residual, rope, kv_caches, meta)
        else:
            for layer, kv_cache in zip(islice(self.layers, self.start, self.end), kv_caches, strict=True):
                hidden, residual = layer.forward(ropes[layer.rope], hidden, residual, kv_cache, meta)
        if not self.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Base of the architecture classes; subclasses set the options below."""

    qkv_bias = False
    norm_cls: type[RMSNorm] = RMSNorm
    qk_norm = False  # see LayerOptions
    sandwich_norms = False
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @staticmethod
    def embed_scale(config: Any) -> float | None:
        return None

    def mlp_for_layer(self, config: Any, layer_idx: int, tp: GroupHandle, quantization: str) -> nn.Module | None:
        """Layer `layer_idx`'s MLP block when it is not the dense GatedMLP (None)."""
        return None

    def layer_options(self, config: Any, layer_idx: int) -> LayerOptions:
        """Layer `layer_idx`'s attention and norm choices: its window, its layer type's
        RoPE table, and the class's qk_norm / sandwich_norms."""
        tables = rope_tables(config)
        rope = config.layer_types[layer_idx] if "default" not in tables else "default"
        return LayerOptions(sliding_window=sliding_windows(config)[layer_idx], qk_norm=self.qk_norm,
                            sandwich_norms=self.sandwich_norms, rope=rope)

    def __init__(self, config: Any, parallel: ParallelState | None = None, quantization: str = "none"):
        """`quantization="int8"` / "int8-weight-only": the layers' projections (qkv, o,
        gate/up, down) hold int8 weights (int8_weight.py). The LM head multiplies by an int8
        copy only under W8A8 (see ParallelLMHead: torch's weight-only kernel is slower than
        the bfloat16 head). NOTE: the embedding and the norms stay in the model dtype: the
        embedding is a row lookup (no matmul to speed up; a tied head's int8 copy leaves
        the inputs unchanged), the norms are a few vectors."""
        super().__init__()
        parallel = parallel or ParallelState()
        check_tensor_parallel(config, parallel.tp.size)
        self.config, self.parallel, self.quantization = config, parallel, quantization
        self.model = DecoderModel(config, parallel, self.qkv_bias, self.norm_cls, self.embed_scale(config),
                                  quantization, lambda i: self.mlp_for_layer(config, i, parallel.tp, quantization),
                                  lambda i: self.layer_options(config, i))
        # Gemma 2: logits -> c * tanh(logits / c)
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if parallel.is_last_stage:
            tied_to = self.model.embed_tokens if self.tied else None  # None on later stages: own copy
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel.tp, tied_to=tied_to,
                                          quantization=quantization)

    @property
    def num_local_layers(self) -> int:
        return self.model.end - self.model.start

    def local_weight_name(self, ckpt_name: str) -> str | None:
        """The parameter a checkpoint tensor loads into on this rank, or None when another
        pipeline stage holds it (the loader then skips reading it)."""
        m = _LAYER_INDEX.match(ckpt_name)
        if m:
            return ckpt_name if self.model.start <= int(m.group(1)) < self.model.end else None
        if ckpt_name.startswith("model.embed_tokens."):
            if self.model.is_first:
                return ckpt_name
            # Tied head on a later stage: the embedding matrix is the head's weight.
            return ckpt_name.replace("model.embed_tokens.", "lm_head.") if self.tied and self.model.is_last else None
        if ckpt_name.startswith("model.norm."):
            return ckpt_name if self.model.is_last else None
        if ckpt_name.startswith("lm_head."):
            return None if self.tied or not self.model.is_last else ckpt_name
        return ckpt_name

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, intermediate=None):
        """input_ids, positions: [T] -> hidden: [T, hidden] (or (hidden, residual) mid-pipeline)"""
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] (sampled positions only) -> logits [S, vocab] (last stage only;
        collective over the TP group)."""
        logits = self.lm_head(hidden)
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits
