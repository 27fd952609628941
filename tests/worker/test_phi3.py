"""Phi-3 (tiny random Phi3ForCausalLM: fused qkv/gate_up checkpoint tensors, LongRoPE with
original length 16, rotary on 12 of 16 head dims) through the whole engine vs HF
transformers: 32 greedy tokens, and logits through the paged cache, in float32 and bfloat16.

Prompts are longer than the original length, so HF runs every forward of its generate()
with the long factors, as our table always does here (rotary.py's module note).
"""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.contract.sampling import SamplingParams
from llmserve.launcher.engine import InProcessEngine
from llmserve.worker.kv_cache import allocate_kv_caches
from llmserve.worker.models.loader import load_model
from tests.tiny_models import make_tiny_model

from .conftest import hf_greedy
from .test_model_vs_hf import BLOCK, _Seq, _step

GEN = 32
_rng = random.Random(11)
PROMPTS = {f"p{i}": [_rng.randrange(3, 300) for _ in range(n)] for i, n in enumerate((17, 24, 40))}
# bfloat16: logits of ours and HF's differ by rounding (8 significant bits; logits here are
# within +-10): measured <= 0.29 apart, while HF's bfloat16 logits are ~1.0 from its float32
# ones. Greedy picks may swap at near-ties: tokens are checked by teacher forcing.
BF16_ATOL = 0.35
BF16_TIE = 0.125


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("phi3"), "phi3", False, seed=2)


def _hf(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _engine_greedy(model_dir, dtype: str) -> dict[str, list[int]]:
    engine = InProcessEngine.from_model_dir(model_dir, dtype=dtype, num_kv_blocks=64)
    sampling = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    out = engine.run([(rid, p, sampling) for rid, p in PROMPTS.items()])
    return {rid: c.output_token_ids for rid, c in out.items()}


def _paged_logits(model_dir, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] from a chunked prefill (two chunks) then one-token decodes."""
    ours = load_model(model_dir, dtype)
    cfg = ours.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 40, BLOCK, cfg.num_key_value_heads, 16, dtype)
    s = _Seq(tokens, list(range(40))[::-1])
    half = len(tokens) // 2
    rows = _step(ours, kv, [(s, 9)]) + _step(ours, kv, [(s, half - 9)])
    rows += [_step(ours, kv, [(s, 1)])[0] for _ in range(len(tokens) - half)]
    return torch.cat(rows).float()


def test_phi3_float32_greedy_and_logits_match_hf(phi3_dir):
    got = _engine_greedy(phi3_dir, "float32")
    assert got == hf_greedy(phi3_dir, PROMPTS, GEN)
    tokens = PROMPTS["p1"] + got["p1"]
    with torch.inference_mode():
        ref = _hf(phi3_dir, torch.float32)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_paged_logits(phi3_dir, torch.float32, tokens), ref, atol=1e-4, rtol=0)


def test_phi3_bfloat16_greedy_and_logits_match_hf(phi3_dir):
    got = _engine_greedy(phi3_dir, "bfloat16")
    hf = _hf(phi3_dir, torch.bfloat16)
    exact = 0
    for rid, prompt in PROMPTS.items():
        assert len(got[rid]) == GEN
        with torch.inference_mode():  # HF's logits at the positions that predicted each of our tokens
            logits = hf(torch.tensor([prompt + got[rid][:-1]])).logits[0, len(prompt) - 1 :].float()
        gaps = logits.max(-1).values - logits[torch.arange(GEN), torch.tensor(got[rid])]
        assert gaps.max() <= BF16_TIE, f"{rid}: token {int(gaps.argmax())} is {gaps.max():.3f} below HF's choice"
        exact += int((gaps == 0).sum())
    assert exact >= 0.9 * GEN * len(PROMPTS)
    tokens = PROMPTS["p2"] + got["p2"]
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(_paged_logits(phi3_dir, torch.bfloat16, tokens), ref, atol=BF16_ATOL, rtol=0)


def test_fused_checkpoint_tensors_split_per_tp_rank():
    """A fused [q | k | v] (and [gate | up]) tensor lands on each rank exactly as the three
    (two) separate tensors would: rank r takes its heads from each part."""
    from llmserve.worker.distributed import GroupHandle
    from llmserve.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    q, k, v = torch.arange(8.0).view(8, 1), torch.arange(100.0, 104.0).view(4, 1), torch.arange(200.0, 204.0).view(4, 1)
    for kv_heads, rank in ((2, 0), (2, 1), (1, 1)):
        k_, v_ = k[: 2 * kv_heads], v[: 2 * kv_heads]
        fused = QKVParallelLinear(1, 2, 4, kv_heads, tp=GroupHandle.detached(2, rank))
        fused.weight_loader(fused.weight, torch.cat([q, k_, v_]))
        split = QKVParallelLinear(1, 2, 4, kv_heads, tp=GroupHandle.detached(2, rank))
        for sid, t in zip("qkv", (q, k_, v_)):
            split.weight_loader(split.weight, t, sid)
        assert torch.equal(fused.weight, split.weight)
    gate_up = MergedColumnParallelLinear(1, [4, 4], tp=GroupHandle.detached(2, 1))
    gate_up.weight_loader(gate_up.weight, torch.arange(8.0).view(8, 1))
    assert gate_up.weight.flatten().tolist() == [2, 3, 6, 7]
