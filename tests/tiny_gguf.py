"""Tiny GGUF files that tests write with the `gguf` package, laid out as llama.cpp's
converter lays out a Llama: its tensor names, q/k rows permuted for its rotary kernel,
norms in F32, a byte-level BPE tokenizer and a chat template in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0 (pad), 1 (bos), 2 (eos)
_TEXT = ("The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital. "
         "A tiny model answers in tokens; the tokenizer merges the letters it sees most often.") * 8
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens by id, merges "a b") of a byte-level BPE trained on a fixed text: the
    special tokens first, then the 256 byte symbols, then the merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([_TEXT], trainer)
    vocab = tokenizer.get_vocab()
    assert len(vocab) == vocab_size, len(vocab)
    pairs = json.loads(tokenizer.to_str())["model"]["merges"]
    return sorted(vocab, key=vocab.get), [" ".join(p) if isinstance(p, list) else p for p in pairs]


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{layer}.{_NAMES[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's q/k rows (per head: the rotary pairs as halves) -> llama.cpp's (interleaved).
    w: [num_heads * head_dim, hidden]."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf_dir: Path, path: Path, weight_type: str = "F32", arch: str = "llama") -> Path:
    """The tiny HF Llama in `hf_dir` (tests/tiny_models.py) as a GGUF at `path`, its
    matrices stored as `weight_type` (F32, F16 or Q8_0; norms stay F32)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = json.loads((hf_dir / "config.json").read_text())
    tokens, merges = byte_level_vocab(cfg["vocab_size"])
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_name("tiny llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
                           + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for hf_name, tensor in load_file(hf_dir / "model.safetensors").items():
        name = _gguf_name(hf_name)
        w = tensor.to(torch.float32).numpy()
        part = name.split(".")[-2]
        if arch == "llama" and part in heads:
            w = _permute(w, heads[part])
        if w.ndim == 1 or weight_type == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif weight_type == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:  # quantized blocks: uint8 [rows, bytes per row]
            writer.add_tensor(name, gguf.quants.quantize(w, Q[weight_type]), raw_dtype=Q[weight_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
