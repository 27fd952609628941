"""Every family added beside Llama, through the three processes as deployed (router,
scheduler, worker over gRPC with mutual TLS): greedy tokens equal transformers' float32
`generate` on the same tiny random checkpoint (every feature of the family switched on:
QK-norm, soft-caps and alternating windows, fused Phi-3 tensors with LongRoPE, a mixture
of experts), with prompts longer than three windows for the windowed family."""

from __future__ import annotations

import asyncio
import random

import pytest

from llmserve.bench.random_model import write_tokenizer
from tests.tiny_models import TINY_WINDOW, make_tiny_model, make_tiny_moe_model, make_tiny_window_model

from .conftest import start_cluster
from .reference import hf_greedy, hf_model

GEN = 24
# NOTE: both past the tiny Phi-3's original context (16): transformers picks LongRoPE's
# factors per sequence length, the engine once for its table (docs/guide/models.md).
PROMPT_LENS = (3 * TINY_WINDOW + 5, 19)

FAMILIES = {
    "qwen3": lambda out: make_tiny_window_model(out, "qwen3"),
    "gemma2": lambda out: make_tiny_window_model(out, "gemma2"),
    "phi3": lambda out: make_tiny_model(out, "phi3", False),
    "gemma3": lambda out: make_tiny_window_model(out, "gemma3"),
    "mixtral": lambda out: make_tiny_moe_model(out, "mixtral"),
    "qwen3_moe": lambda out: make_tiny_moe_model(out, "qwen3_moe"),
    "olmoe": lambda out: make_tiny_moe_model(out, "olmoe"),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_through_the_cluster_matches_transformers(family, tmp_path):
    model_dir = FAMILIES[family](tmp_path / family)
    config = hf_model.__wrapped__(str(model_dir)).config  # (uncached: one model per family)
    write_tokenizer(model_dir, config.vocab_size, config.bos_token_id, config.eos_token_id)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    cluster = start_cluster(model_dir, tmp_path / "logs", worker_args=["--num-kv-blocks", "64"])
    try:
        async with cluster.client() as client:
            async def greedy(ids):
                out = []
                async for delta in client.generate(token_ids=ids, max_tokens=GEN, temperature=0.0, ignore_eos=True):
                    out += delta.token_ids
                return out

            ours = await asyncio.gather(*(greedy(p) for p in prompts))  # batched in the engine
    finally:
        cluster.stop()
    hf_model.cache_clear()
    for prompt, got in zip(prompts, ours):
        want, _ = hf_greedy(str(model_dir), prompt, GEN)
        assert got == want, (family, len(prompt))
    hf_model.cache_clear()
