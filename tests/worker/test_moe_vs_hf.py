"""Mixture-of-experts families (tiny random checkpoints, 8 experts, top-2) through the
paged KV cache vs HF transformers on the CPU.

float32: greedy ids of a batched prefill + 31 decode steps equal HF generate()'s for
every prompt, and our logits at each step equal HF's full forward over the same ids.
bfloat16: prompts with their continuations, prefilled in one step, give HF's logits at
every position within bfloat16 noise. NOTE: a bfloat16 generation is not compared token
for token: incremental attention rounds differently from a full forward, and where a
router's k-th and (k+1)-th experts are that close the choice flips, moving the logits by
far more than bfloat16 noise (measured on one such Mixtral: a token 1.19 below HF's
teacher-forced choice, where the dense tiny Llama stays within 0.34 of HF's logits).
"""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.worker.distributed import ParallelState
from llmserve.worker.models.loader import load_model
from tests.parallel.harness import greedy
from tests.tiny_models import make_tiny_moe_model

from .conftest import hf_greedy, hf_model

STEPS = 32
_rng = random.Random(11)
PROMPTS = {f"p{i}": [_rng.randrange(3, 300) for _ in range(n)] for i, n in enumerate((5, 13, 1, 8))}
# family -> overrides: Qwen3-MoE with a dense layer (mlp_only_layers) between sparse ones;
# OLMoE (no renormalised top-k) clamping q, k, v at 2 (its normed q and k reach past it)
FAMILIES = {"mixtral": {}, "qwen3_moe": {"mlp_only_layers": [1]}, "olmoe": {"clip_qkv": 2.0}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_dir(request, tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp(request.param), request.param, seed=4,
                               **FAMILIES[request.param])


def _hf_logits(hf, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """HF's logits at the positions that predicted each of `gen`: [len(gen), V] float32."""
    with torch.inference_mode():
        return hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1 : -1].float()


def test_float32_greedy_and_logits_match_hf(moe_dir):
    ours = load_model(moe_dir, "float32")
    assert type(ours).__name__ == ours.config.architectures[0]
    dense = set(getattr(ours.config, "mlp_only_layers", None) or [])
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == [
        "GatedMLP" if i in dense else "SparseMoeBlock" for i in range(ours.config.num_hidden_layers)]
    prompts = list(PROMPTS.values())
    tokens, logits = greedy(ours, ParallelState(), prompts, STEPS)
    assert dict(zip(PROMPTS, tokens)) == hf_greedy(moe_dir, PROMPTS, STEPS)
    hf = hf_model(moe_dir)
    for prompt, gen, mine in zip(prompts, tokens, logits):
        torch.testing.assert_close(mine, _hf_logits(hf, prompt, gen), atol=2e-4, rtol=0)


def _prefill_logits(model, seqs: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """One step prefilling every sequence at once: logits at every position, [len(seq), V] each."""
    from llmserve.worker.attention import TorchPagedAttention
    from llmserve.worker.kv_cache import allocate_kv_caches
    from llmserve.worker.models.decoder import head_dim_of

    cfg, block = model.config, 4
    need = [-(-len(s) // block) for s in seqs]
    tables = [list(range(sum(need[:i]), sum(need[: i + 1]))) for i in range(len(seqs))]
    slots = [t[j // block] * block + j % block for s, t in zip(seqs, tables) for j in range(len(s))]
    kv = allocate_kv_caches(cfg.num_hidden_layers, sum(need), block, cfg.num_key_value_heads, head_dim_of(cfg), dtype)
    meta = TorchPagedAttention.build_metadata([len(s) for s in seqs], [len(s) for s in seqs], tables,
                                              torch.tensor(slots), block)
    ids, pos = sum(seqs, []), [j for s in seqs for j in range(len(s))]
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), kv, meta)).float()
    return list(logits.split([len(s) for s in seqs]))


def test_bfloat16_prefill_matches_hf(moe_dir):
    """Prompts and their float32 greedy continuations, prefilled in one bfloat16 step: the
    logits at every position match HF's bfloat16 forward of each sequence alone."""
    from transformers import AutoModelForCausalLM

    prompts = list(PROMPTS.values())
    tokens, _ = greedy(load_model(moe_dir, "float32"), ParallelState(), prompts, STEPS)
    seqs = [p + t for p, t in zip(prompts, tokens)]
    mine = _prefill_logits(load_model(moe_dir, "bfloat16"), seqs, torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16).eval()
    for seq, got in zip(seqs, mine):
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0].float()
        # bfloat16 noise: a few ulps of logits around 10 (the rows of a batch meet their
        # GEMMs and attention in another order than HF's one sequence does)
        torch.testing.assert_close(got, ref, atol=0.5, rtol=0)
        assert (got - ref).abs().mean() < 0.02
