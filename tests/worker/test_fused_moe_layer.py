"""FusedMoE (the CPU path: pairs grouped by expert, each expert's packed or dense GEMMs)
vs a plain per-expert torch reference; its weight loaders (per-expert and stacked
checkpoint tensors, TP slices); the router's top-k rule."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels.triton.fused_moe import fused_moe_reference
from llmserve.worker.distributed import GroupHandle
from llmserve.worker.layers.fused_moe import FusedMoE, expert_weight_name, select_experts

E, H, I, TOP_K = 6, 32, 24, 2


def _experts(seed: int = 0):
    """Full checkpoint tensors: gate, up [E, I, H]; down [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
            torch.randn(E, H, I, generator=g) / I**0.5)


def _layer(gate, up, down, tp: GroupHandle = GroupHandle(), dtype=torch.float32, process: bool = True) -> FusedMoE:
    """Loaded one checkpoint tensor at a time; `process`: then packed (CPU) as after a model load."""
    layer = FusedMoE(E, H, I, "silu", tp).to(dtype)
    for e in range(E):
        for part, t in (("gate", gate[e]), ("up", up[e])):
            layer.weight_loader(layer.w13_weight, t.to(dtype), (e, part))
        layer.weight_loader(layer.w2_weight, down[e].to(dtype), (e, "down"))
    if process:
        layer.process_weights_after_loading()
    return layer


def _route(T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), select_experts(torch.randn(T, E, generator=g), TOP_K, True)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_grouped_path_matches_per_expert_reference(T, dtype, packed):
    gate, up, down = _experts()
    layer = _layer(gate, up, down, dtype=dtype, process=packed)
    x, (w, ids) = _route(T, seed=T)
    x = x.to(dtype)
    ref = fused_moe_reference(x, torch.cat([gate, up], dim=1).to(dtype), down.to(dtype), w, ids)
    out = layer(x, w, ids)
    assert out.dtype == dtype and out.shape == (T, H)
    torch.testing.assert_close(out, ref, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


def test_tensor_parallel_slices_sum_to_the_full_layer():
    """Each rank holds gate/up rows and down columns r*I/2 .. (r+1)*I/2 of every expert: the
    ranks' partial outputs (before the all-reduce) add up to the unsplit layer's."""
    gate, up, down = _experts()
    x, (w, ids) = _route(9)
    full = _layer(gate, up, down)(x, w, ids)
    ranks = [_layer(gate, up, down, GroupHandle.detached(2, r)) for r in range(2)]
    unpacked = _layer(gate, up, down, GroupHandle.detached(2, 0), process=False)
    assert unpacked.w13_weight.shape == (E, I, H) and unpacked.w2_weight.shape == (E, H, I // 2)
    torch.testing.assert_close(sum(r.forward_grouped(x, w, ids) for r in ranks), full, atol=1e-5, rtol=0)


def test_stacked_checkpoint_tensors_load_like_per_expert_ones():
    """transformers 5's in-memory layout: experts.gate_up_proj [E, 2I, H] (gate | up), experts.down_proj [E, H, I]."""
    gate, up, down = _experts()
    for tp in (GroupHandle(), GroupHandle.detached(2, 1)):
        want = _layer(gate, up, down, tp, process=False)
        got = FusedMoE(E, H, I, "silu", tp)
        got.weight_loader(got.w13_weight, torch.cat([gate, up], dim=1), (None, "gate_up"))
        got.weight_loader(got.w2_weight, down, (None, "down"))
        assert torch.equal(got.w13_weight, want.w13_weight) and torch.equal(got.w2_weight, want.w2_weight)


def test_a_missing_expert_weight_is_an_error():
    gate, up, down = _experts()
    layer = FusedMoE(E, H, I, "silu")
    for e in range(E):
        layer.weight_loader(layer.w13_weight, gate[e], (e, "gate"))
        layer.weight_loader(layer.w2_weight, down[e], (e, "down"))
        if e != 3:
            layer.weight_loader(layer.w13_weight, up[e], (e, "up"))
    with pytest.raises(ValueError, match="expert 3 up"):
        layer.process_weights_after_loading()
    with pytest.raises(ValueError, match="checkpoint shard"):
        layer.weight_loader(layer.w2_weight, down[0].t(), (0, "down"))


def test_checkpoint_names_of_expert_weights():
    assert expert_weight_name("model.layers.3.mlp.experts.7.w1.weight") == ("model.layers.3.mlp.experts.w13_weight",
                                                                            (7, "gate"))
    assert expert_weight_name("model.layers.0.mlp.experts.12.down_proj.weight") == (
        "model.layers.0.mlp.experts.w2_weight", (12, "down"))
    assert expert_weight_name("model.layers.0.mlp.experts.gate_up_proj") == (
        "model.layers.0.mlp.experts.w13_weight", (None, "gate_up"))
    assert expert_weight_name("model.layers.0.mlp.gate.weight") is None
    assert expert_weight_name("model.layers.0.mlp.gate_proj.weight") is None  # a dense layer's


def test_router_renormalised_top_k_is_a_softmax_over_the_chosen_logits():
    logits = torch.randn(11, E)
    w, ids = select_experts(logits, TOP_K, renormalize=True)
    torch.testing.assert_close(w, torch.gather(logits, 1, ids).softmax(-1))
    raw, _ = select_experts(logits, TOP_K, renormalize=False, weights_dtype=torch.bfloat16)
    assert raw.dtype == torch.bfloat16 and bool((raw.float().sum(-1) < 1).all())
