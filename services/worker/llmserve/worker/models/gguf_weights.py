"""A GGUF's tensors under HF checkpoint names, for loader.load_weights: read one at a time
from the memory-mapped file and dequantized as they are read (the host holds one
dequantized tensor at a time; see llmserve/gguf_checkpoint.py for why not transformers').

  F32, F16, BF16     handed over as stored (the weight loader casts to the model dtype)
  quantized blocks   (Q8_0, Q4_1, Q4_K, Q6_K, ...) dequantized to float32 by the gguf
                     package, then cast by the weight loader; with `--quantization int8`
                     the loader requantizes each row (int8_weight.quantize_rows).

NOTE: Q8_0 is requantized, not kept. Its int8 values carry one float16 scale per 32
input columns (W [out, in] = q [out, in] * s [out, in/32] broadcast per block); our int8
layout and the W8A8 kernel hold one scale per output row (sums in int32 along the whole
row, one float multiply at the end). Per-block scales would need a float multiply per
32 columns inside the kernel, a different kernel. Requantizing a dequantized Q8_0 row
per channel adds at most half a step of the row's scale (max|row| / 254) to each weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.gguf_checkpoint import ARCHITECTURES

# blk.{i}.<part> -> model.layers.{i}.<module>
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """The HF checkpoint name of a GGUF tensor ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); a name without one comes back as it is
    (load_weights then reports it as unexpected)."""
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        module = _BLOCK_NAMES.get(part)
        return f"model.layers.{layer}.{module}.{suffix}" if module else gguf_name
    module = _TOP_NAMES.get(stem)
    return f"{module}.{suffix}" if module else gguf_name


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. Per head, HF keeps the rotary pairs as halves
    (rows [0, d/2) pair with [d/2, d)); llama.cpp interleaves them (row 2j pairs with
    2j+1) for its rotary kernel.
    w: [num_heads * head_dim, ...] interleaved -> the same shape in HF's order."""
    rest = w.shape[1:]
    # [heads, head_dim/2 (pair j), 2 (which half), ...] -> [heads, 2, head_dim/2, ...]
    return w.reshape(num_heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


def tensor_of(t: Any) -> torch.Tensor:
    """One ReaderTensor's values: float tensors as stored, quantized ones dequantized to
    float32; shape [rows, cols] (GGUF lists dimensions innermost first: [cols, rows])."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type in (Q.F32, Q.F16):
        values = torch.from_numpy(np.array(t.data))  # (a copy: the memory map is read-only)
    elif t.tensor_type == Q.BF16:
        values = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    else:
        values = torch.from_numpy(dequantize(t.data, t.tensor_type))
    return values.reshape(shape)


def iter_gguf(gguf_path: Path, config: Any, keep: Callable[[str], bool] | None = None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the GGUF, one at a time; names `keep`
    rejects are never read (a pipeline stage reads only its own layers)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    permuted = ARCHITECTURES[arch]["permuted_qk"]
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    for t in reader.tensors:
        name = hf_name(t.name)
        if keep is not None and not keep(name):
            continue
        tensor = tensor_of(t)
        module = name.split(".")[-2] if name.startswith("model.layers.") else ""
        if permuted and f"self_attn.{module}" in heads:
            tensor = unpermute_rows(tensor, heads[f"self_attn.{module}"])
        yield name, tensor
