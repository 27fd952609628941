"""TP=2, PP=2 and TP=2 x PP=2 groups (spawned processes, gloo) give the same greedy ids
as TP=1 and HF transformers; each rank holds only its shard of the weights."""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import MODELS, PROMPTS, STEPS
from .harness import run_group

ATOL = 1e-4


def _check_outputs(results, references, names, driver: int) -> None:
    for job, name in enumerate(names):
        ref_tokens, ref_logits, _, hf_tokens = references[name]
        assert ref_tokens == hf_tokens, f"{name}: TP=1 differs from HF"
        for rank, per_job in results.items():
            assert per_job[job].tokens == ref_tokens, f"{name}: rank {rank} differs from TP=1"
        for got, want in zip(results[driver][job].logits, ref_logits):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def _check_shards(results, references, names, tp: int, pp: int) -> None:
    """Sharded tensors hold 1/tp of the full tensor (norms and replicated KV excepted); a
    stage holds only its layers."""
    for job, name in enumerate(names):
        full = references[name][2]
        cfg = MODELS[name][2]
        num_layers = cfg.get("num_hidden_layers", 3)
        kv = cfg.get("num_key_value_heads", 2)
        seen: set[str] = set()
        for rank, per_job in results.items():
            mine = per_job[job].param_shapes
            seen |= set(mine)
            stage = rank // tp
            lo, hi = stage * num_layers // pp, (stage + 1) * num_layers // pp
            assert per_job[job].num_kv_caches == hi - lo
            for n, shape in mine.items():
                if n.startswith("model.layers."):
                    assert lo <= int(n.split(".")[2]) < hi, f"rank {rank} holds {n}"
                ref = full.get(n, full.get("model.embed_tokens.weight") if n == "lm_head.weight" else None)
                if "norm" in n:
                    assert shape == ref
                elif "qkv_proj" in n and kv < tp:
                    q_rows, kv_rows = 4 * 16, 16  # 4 heads of 16; one kv head per rank
                    assert shape[0] == q_rows // tp + 2 * kv_rows
                elif "o_proj.bias" in n or "down_proj.bias" in n:
                    assert shape == ref
                else:
                    assert math.prod(shape) * tp == math.prod(ref), f"{n}: {shape} vs full {ref}"
        # Together the ranks hold every tensor (tied heads: lm_head is the embedding).
        assert {n for n in full} <= seen


@pytest.mark.parametrize("tp,pp,names", [
    (2, 1, ["llama_kv2", "qwen2_kv1", "gemma", "phi3"]),
    (1, 2, ["llama_kv2", "qwen2_kv1", "gemma"]),
    (2, 2, ["llama_kv2", "qwen2_kv1"]),
], ids=["tp2", "pp2", "tp2xpp2"])
def test_group_matches_tp1_and_hf(tp, pp, names, parallel_models, references):
    jobs = [(str(parallel_models[n]), PROMPTS, STEPS) for n in names]
    results = run_group(tp, pp, jobs)
    driver = (pp - 1) * tp
    _check_outputs(results, references, names, driver)
    _check_shards(results, references, names, tp, pp)
