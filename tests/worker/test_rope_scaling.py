"""RoPE scaling types against transformers 5.23: inv_freq and the attention factor equal
`ROPE_INIT_FUNCTIONS` for each type, and a tiny random Llama with each scaling gives HF's
logits at positions beyond original_max_position_embeddings (float32)."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.worker.layers.rotary import RotaryEmbedding, rope_inv_freq, rope_parameters
from tests.tiny_models import make_tiny_model

from .test_model_vs_hf import ATOL, BLOCK, _step

LONG = {"short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 9.0]}
# name -> RoPE settings (rope_theta 1e4, head_dim 16: 8 frequencies, 6 with partial 0.75)
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_no_factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", **LONG, "original_max_position_embeddings": 64},
    "longrope_attn": {"rope_type": "longrope", **LONG, "factor": 3.0, "attention_factor": 1.3,
                      "original_max_position_embeddings": 64},
    "longrope_partial": {"rope_type": "longrope", "short_factor": LONG["short_factor"][:6],
                         "long_factor": LONG["long_factor"][:6], "original_max_position_embeddings": 64,
                         "partial_rotary_factor": 0.75},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


def _hf_config(rope: dict, max_pos: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                       rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("max_pos", [64, 256])
def test_inv_freq_and_attention_factor_equal_hf(name, max_pos):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _hf_config(dict(CASES[name]), max_pos)
    kind = cfg.rope_parameters["rope_type"]
    params = rope_parameters(cfg)
    # Our table has max_pos rows: HF's values for a sequence that long (module note in rotary.py).
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=max_pos)
    got, factor = rope_inv_freq(params, 16, max_pos)
    assert torch.equal(got, want.float()), name
    assert factor == pytest.approx(want_factor, rel=1e-12)
    # Longer tables: dynamic grows its base, longrope switches to the long factors.
    got2, _ = rope_inv_freq(params, 16, 4 * max_pos)
    assert torch.equal(got2, ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=4 * max_pos)[0].float())


def test_longrope_short_and_long_factors_and_su_alias():
    from types import SimpleNamespace

    old = SimpleNamespace(rope_scaling={"type": "su", **LONG}, rope_theta=1e4, max_position_embeddings=256,
                          original_max_position_embeddings=64)
    params = rope_parameters(old)
    assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == 64
    short, factor = rope_inv_freq(params, 16, 64)  # table within the original length: short factors
    long, _ = rope_inv_freq(params, 16, 256)
    base = 1e4 ** (-torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    torch.testing.assert_close(short, base / torch.tensor(LONG["short_factor"]))
    torch.testing.assert_close(long, base / torch.tensor(LONG["long_factor"]))
    assert factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    rope = RotaryEmbedding(16, 256, params, dtype=torch.float32)  # cos/sin carry the attention factor
    torch.testing.assert_close(rope.cos[0], torch.full((8,), factor))


def test_partial_rotary_leaves_the_tail_of_each_head():
    from llmserve.worker.layers.rotary import apply_rotary, apply_rotary_qkv

    H, KVH, D = 4, 2, 16
    rope = RotaryEmbedding(D, 64, {"rope_theta": 1e4, "partial_rotary_factor": 0.5}, dtype=torch.float32)
    assert rope.cos.shape == (64, 4)
    qkv = torch.randn(5, (H + 2 * KVH) * D)
    cs = rope(torch.arange(5))
    q, k, v = apply_rotary_qkv(qkv.clone(), cs, H, KVH, D)
    ref = qkv.view(5, H + 2 * KVH, D)
    torch.testing.assert_close(q[..., :8], apply_rotary(ref[:, :H, :8], cs))
    torch.testing.assert_close(k[..., :8], apply_rotary(ref[:, H : H + KVH, :8], cs))
    assert torch.equal(q[..., 8:], ref[:, :H, 8:]) and torch.equal(v, ref[:, H + KVH :])


# Tiny Llamas: original length 32, max_position_embeddings 256 (table); prompts of 40-70
# tokens, so the checked positions lie beyond the original length.
MODEL_ROPES = ["linear", "dynamic", "yarn", "longrope", "llama3"]


@pytest.mark.parametrize("kind", MODEL_ROPES)
def test_tiny_llama_with_scaled_rope_matches_hf(kind, tmp_path):
    from llmserve.worker.kv_cache import allocate_kv_caches
    from llmserve.worker.models.loader import load_model

    from .conftest import hf_model
    from .test_model_vs_hf import _Seq

    d = make_tiny_model(tmp_path, kind, True, num_hidden_layers=2)
    ours = load_model(d, "float32")
    hf = hf_model(d)
    cfg = ours.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 64, BLOCK, cfg.num_key_value_heads, 16, torch.float32)
    g = torch.Generator().manual_seed(1)
    a = _Seq(torch.randint(3, 300, (41,), generator=g).tolist(), list(range(0, 24)))
    b = _Seq(torch.randint(3, 300, (70,), generator=g).tolist(), list(range(24, 48))[::-1])
    la, lb = _step(ours, kv, [(a, 41), (b, 70)])
    a.tokens.append(int(la[-1].argmax()))
    la2 = _step(ours, kv, [(a, 1)])[0]  # one decode beyond the prefill
    for mine, s in ((torch.cat([la, la2]), a), (lb, b)):
        with torch.inference_mode():
            ref = hf(torch.tensor([s.tokens[: mine.shape[0]]])).logits[0]
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)  # positions 0..69, original length 32
