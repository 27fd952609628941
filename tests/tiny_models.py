"""Tiny random-weight HF checkpoints that tests create (no hub downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
    initializer_range=0.25, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
VARIANTS = {
    "llama_tied": ("llama", True),
    "llama_untied": ("llama", False),
    "qwen2_untied": ("qwen2", False),
    "llama3_rope": ("llama3", True),
}
ROPE = {
    "llama": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    # Scaled RoPE types (tests/worker/test_rope_scaling.py); yarn/longrope extend 32 -> 256.
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                 "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5],
                 "long_factor": [1.0, 1.4, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0]},
}


def make_tiny_model(out_dir: Path, kind: str, tied: bool, seed: int = 0, **overrides) -> Path:
    """kind: a ROPE key (Llama) | qwen2 | gemma | phi3; overrides replace TINY's values (e.g.
    num_key_value_heads=1, num_hidden_layers=4)."""
    from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    base = {**TINY, **overrides}
    if kind in ROPE:
        cfg = LlamaConfig(**base, tie_word_embeddings=tied, rope_parameters=ROPE[kind])
        model = LlamaForCausalLM(cfg)
    elif kind == "phi3":  # fused qkv/gate_up in the checkpoint; LongRoPE 16 -> 256; rotary on 12 of 16 dims
        from transformers import Phi3Config, Phi3ForCausalLM

        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.4], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]}
        cfg = Phi3Config(**{"original_max_position_embeddings": 16, "sliding_window": None, **base},
                         tie_word_embeddings=tied, rope_parameters=rope)
        model = Phi3ForCausalLM(cfg)
    elif kind == "gemma":  # (1 + w) norms, scaled embeddings, GeGLU; head_dim set explicitly
        cfg = GemmaConfig(**base, head_dim=base["hidden_size"] // base["num_attention_heads"],
                          hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)
        model = GemmaForCausalLM(cfg)
        with torch.no_grad():  # random norm gains (HF initializes them to 0, i.e. gain 1)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    else:
        cfg = Qwen2Config(**base, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random (non-zero) q/k/v biases so they matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


# Mixture-of-experts families: kind -> (config class, model class) names in transformers.
MOE_KINDS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
}


def make_tiny_moe_model(out_dir: Path, kind: str, seed: int = 0, num_experts: int = 8, **overrides) -> Path:
    """A tiny top-2 mixture-of-experts checkpoint (kind: mixtral | qwen3_moe | olmoe) with
    `num_experts` experts of intermediate size 32; random router and norm weights (HF
    starts some at 0 or 1, which would hide a wrong router or norm)."""
    import transformers

    torch.manual_seed(seed)
    config_cls, model_cls = (getattr(transformers, n) for n in MOE_KINDS[kind])
    base = {**TINY, "num_experts_per_tok": 2, "intermediate_size": 32, "tie_word_embeddings": False, **overrides}
    experts = {"num_local_experts": num_experts} if kind == "mixtral" else {"num_experts": num_experts}
    if kind == "qwen3_moe":  # intermediate_size: the dense layers' (mlp_only_layers)
        base = {"moe_intermediate_size": 32, "norm_topk_prob": True, "head_dim": 16, **base, "intermediate_size": 96}
    model = model_cls(config_cls(**base, **experts)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


# Families with QK-norm, soft-caps or sliding windows (tests/worker/test_window_models_vs_hf.py).
# A tiny window (8 tokens) so that prompts of a few dozen tokens leave it several times over.
TINY_WINDOW = 8


def make_tiny_window_model(out_dir: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """kind: qwen3 (QK-norm) | mistral (every layer windowed) | gemma2 (alternating
    windowed/full layers, attention and final soft-caps, query_pre_attn_scalar, sandwich
    norms) | gemma3 (QK-norm, 5 windowed : 1 full, a RoPE base per layer type, linear
    scaling on the full layers). head_dim 16; random norm gains (HF starts them at 0 or 1,
    which would hide a norm applied wrongly)."""
    import transformers

    torch.manual_seed(seed)
    layers = {"gemma2": 4, "gemma3": 6}.get(kind, TINY["num_hidden_layers"])  # a full layer after the windowed ones
    base = {**TINY, "head_dim": 16, "num_hidden_layers": layers, **overrides}
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(**base, tie_word_embeddings=False)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**base, sliding_window=TINY_WINDOW, tie_word_embeddings=False)
    elif kind == "gemma2":  # softcaps small enough to bite on these logits
        cfg = transformers.Gemma2Config(**base, sliding_window=TINY_WINDOW,
                                        query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                                        final_logit_softcapping=6.0, attn_implementation="eager")
    elif kind == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}
        cfg = transformers.Gemma3TextConfig(**base, sliding_window=TINY_WINDOW,
                                            query_pre_attn_scalar=24, rope_parameters=rope,
                                            attn_implementation="eager")
    else:
        raise ValueError(f"unknown kind {kind!r}")
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if kind.startswith("gemma") else 1.0, 0.3)
    model.save_pretrained(out_dir)
    return out_dir
