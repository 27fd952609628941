"""Mixture-of-experts models (tiny, 8 experts, top-2) at TP=2 (spawned processes, gloo)
give the same greedy ids and logits as TP=1, each rank holding half of every expert's
intermediate size and the whole router."""

from __future__ import annotations

import torch

from llmserve.worker.distributed import ParallelState
from llmserve.worker.models.loader import load_model
from tests.tiny_models import make_tiny_moe_model

from .conftest import PROMPTS, STEPS
from .harness import greedy, resident_weight_shapes, run_group


def test_moe_tp2_matches_tp1(tmp_path):
    """Mixtral; OLMoE with one KV head (replicated on both ranks), whose whole-projection
    q/k norms all-reduce their sums of squares."""
    dirs = [make_tiny_moe_model(tmp_path / "mixtral", "mixtral", seed=3),
            make_tiny_moe_model(tmp_path / "olmoe", "olmoe", seed=3, num_key_value_heads=1)]
    results = run_group(2, 1, [(str(d), PROMPTS, STEPS) for d in dirs])
    for job, d in enumerate(dirs):
        ref = load_model(d, "float32")
        ref_tokens, ref_logits = greedy(ref, ParallelState(), PROMPTS, STEPS)
        full = resident_weight_shapes(ref)
        for rank, per_job in results.items():
            assert per_job[job].tokens == ref_tokens, f"{d.name}: rank {rank} differs from TP=1"
            # The router is whole on every rank (each expert's TP slices: test_fused_moe_layer.py).
            router = "model.layers.0.mlp.gate.weight"  # (Mixtral's checkpoint: block_sparse_moe.gate.weight)
            assert per_job[job].param_shapes[router] == full[router]
        for got, want in zip(results[0][job].logits, ref_logits):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
