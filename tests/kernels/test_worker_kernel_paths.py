"""The worker's CUDA paths, run here through Triton's interpreter on CPU tensors: each
one against the plain torch path the CPU worker takes.

- RMSNorm.forward_cuda (Triton rms_norm, fused residual) vs forward_native;
- rotary through the Triton kernel (whole tables + positions) vs gathered rows;
- the sampler's Triton top-k/top-p filter vs its torch filter;
- the CUDA-graph decode path's padding and static buffers, with each "graph" replayed
  eagerly: tokens and the KV cache equal to eager steps.
"""

from __future__ import annotations

import pytest
import torch

from llmserve.contract.sampling import SamplingParams as P
from llmserve.worker.layers.norm import RMSNorm
from llmserve.worker.layers.rotary import Rope, RotaryEmbedding, apply_rotary_qkv
from tests.kernels.conftest import INTERPRET
from tests.kernels.helpers import rel_err

cpu_only = pytest.mark.skipif(not INTERPRET, reason="runs the worker's CUDA paths under Triton's interpreter")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_cuda_path_matches_native(dtype, with_residual, device):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, eps=1e-5).to(device, dtype)
    norm.weight.data = (torch.randn(96, generator=g) * 0.5 + 1).to(device, dtype)
    x = torch.randn(7, 96, generator=g).to(device, dtype)
    res = torch.randn(7, 96, generator=g).to(device, dtype) if with_residual else None
    want = norm.forward_native(x.clone(), None if res is None else res.clone())
    got = norm.forward_cuda(x.clone(), None if res is None else res.clone())
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # NOTE: the interpreter rounds to bf16 by truncation
    if with_residual:
        assert rel_err(got[1].float(), want[1].float()) <= tol  # the residual stream: x + residual
        want, got = want[0], got[0]
    assert rel_err(got.float(), want.float()) <= tol


# Partial rotary (Phi-4-mini: 0.75 of each head) with LongRoPE's attention factor in cos/sin.
_PARTIAL_LONGROPE = {"rope_theta": 10000.0, "rope_type": "longrope", "partial_rotary_factor": 0.75,
                     "original_max_position_embeddings": 32, "short_factor": [1.0] * 12,
                     "long_factor": [1.0 + i / 4 for i in range(12)]}


@pytest.mark.parametrize("params", [{"rope_theta": 10000.0, "rope_type": "default"}, _PARTIAL_LONGROPE],
                         ids=["default", "partial-longrope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_through_the_triton_kernel_matches_gathered_rows(dtype, params, device):
    heads, kv_heads, head_dim, T = 4, 2, 32, 9
    rope = RotaryEmbedding(head_dim, 128, params, dtype=dtype).to(device)
    positions = torch.tensor([0, 5, 6, 7, 100, 3, 64, 65, 127], device=device)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    rows = Rope(rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1))
    want = apply_rotary_qkv(qkv.clone(), rows, heads, kv_heads, head_dim)
    got = apply_rotary_qkv(qkv.clone(), Rope(rope.cos, rope.sin, positions), heads, kv_heads, head_dim)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the kernel rotates in fp32, the torch path in dtype
    for a, b in zip(got, want):
        assert a.shape == b.shape and rel_err(a.float(), b.float()) <= tol


def test_sampler_triton_filter_keeps_what_the_torch_filter_keeps(device):
    from llmserve.kernels.triton import top_k_top_p_filter
    from llmserve.worker.sampler import SamplingRows, _filtered_probs

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 300, generator=g) * 4).to(device)
    params = [P(temperature=0.7, top_k=5), P(temperature=1.0, top_p=0.8), P(temperature=1.3, top_k=40, top_p=0.5),
              P(temperature=1.0, top_k=0, top_p=1.0), P(temperature=0.9, top_k=1), P(temperature=2.0, top_p=0.01)]
    want = _filtered_probs(logits.cpu(), SamplingRows.from_params(params, [0] * 6))  # the CPU path
    temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
    ks = torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device)
    ps = torch.tensor([p.top_p for p in params], device=device)
    got = top_k_top_p_filter(logits / temps, ks, ps).softmax(dim=-1).cpu()
    assert torch.equal(got > 0, want > 0)  # the same tokens survive
    assert rel_err(got, want) <= 1e-5


def _emulate_capture(graphs) -> None:
    """What DecodeGraphs.capture records, replayed eagerly: each "graph" reruns the
    forward on the static buffers and writes into its output tensor, as a replay does."""

    class EagerGraph:
        def __init__(self, size):
            self.size = size

        def replay(self):
            graphs.outputs[self.size].copy_(graphs._forward(self.size))

    with torch.inference_mode():
        for size in sorted(graphs.sizes, reverse=True):
            graphs.outputs[size] = graphs._forward(size)  # slot -1 everywhere: writes no KV
            graphs.graphs[size] = EagerGraph(size)


@cpu_only
def test_padded_graph_decode_steps_equal_eager_steps(tiny_llama_dir, monkeypatch):
    """Batches of 3 and 5 decode rows run at captured sizes 4 and 8 (padding rows: slot -1,
    one key of block 0); tokens, logits and every KV block equal eager steps, and a
    multi-step plan replays per step."""
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.cuda_graphs import DecodeGraphs
    from llmserve.worker.model_runner import ModelRunner
    from tests.worker.conftest import PlanDriver

    prompts = {f"r{i}": list(range(3 + i, 14 + 2 * i)) for i in range(5)}
    results = {}
    for mode in ("eager", "graphs"):
        runner = ModelRunner(tiny_llama_dir, RunnerConfig(num_kv_blocks=40, block_size=16, attention_backend="triton",
                                                          swap_space=0, max_num_seqs=8))
        replays = []
        if mode == "graphs":
            runner.graphs = runner._decode_graphs(runner.kv_caches)
            assert runner.graphs.sizes == [1, 2, 4, 8]
            _emulate_capture(runner.graphs)
            replay = DecodeGraphs.replay
            monkeypatch.setattr(DecodeGraphs, "replay",
                                lambda self, size, *a: replays.append((size, a[0].shape[0])) or replay(self, size, *a))
        drv = PlanDriver(runner, 16, 40, seed=0)
        for rid, prompt in prompts.items():
            drv.add(rid, prompt)
        drv.step({rid: None for rid in prompts})  # prefills: eager in both modes
        for _ in range(2):
            drv.step({rid: None for rid in ("r0", "r1", "r2")})  # 3 rows -> graph of 4
        drv.step({rid: None for rid in prompts})  # 5 rows -> graph of 8
        drv.step({rid: None for rid in ("r3", "r4")}, num_steps=3)  # multi-step: a replay per step
        results[mode] = ({rid: drv.outputs(rid) for rid in prompts}, [c.clone() for c in runner.kv_caches], replays)
    (eager_tokens, eager_kv, _), (graph_tokens, graph_kv, replays) = results["eager"], results["graphs"]
    assert graph_tokens == eager_tokens
    assert [len(t) for t in eager_tokens.values()] == [4, 4, 4, 5, 5]
    assert replays == [(4, 3), (4, 3), (8, 5), (2, 2), (2, 2), (2, 2)]
    for a, b in zip(graph_kv, eager_kv):
        assert torch.equal(a, b)  # padding rows wrote nothing; real rows wrote the same


@cpu_only
def test_block_sizes_the_triton_backend_cannot_run_are_refused_at_start(tiny_llama_dir):
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.model_runner import ModelRunner

    for bad in (8, 24):
        with pytest.raises(ValueError, match=f"--block-size {bad}: the triton attention backend needs a power of two"):
            ModelRunner(tiny_llama_dir, RunnerConfig(num_kv_blocks=8, block_size=bad, attention_backend="triton",
                                                     swap_space=0))
    # The torch backend takes any size.
    assert ModelRunner(tiny_llama_dir, RunnerConfig(num_kv_blocks=8, block_size=8, swap_space=0)).block_size == 8


@cpu_only
def test_mixed_steps_through_the_pieces_with_triton_attention_equal_eager_steps(tiny_llama_dir):
    """The piecewise path with the Triton backend's attention between the pieces (the
    keys already stored: kv_stored): prefills, a chunk over cached context and decodes,
    padded to 32 and 8 tokens, give the tokens and KV cache of eager steps."""
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.model_runner import ModelRunner
    from llmserve.worker.piecewise_graphs import PiecewiseGraphs
    from tests.worker.conftest import PlanDriver

    prompts = {"a": list(range(3, 23)), "b": list(range(40, 51)), "c": list(range(60, 100))}
    schedule = [{"a": None, "b": None}, {"a": None, "b": None, "c": 24}, {"a": None, "b": None, "c": None},
                {"a": None, "b": None, "c": None}]
    results = {}
    for mode in ("eager", "piecewise"):
        runner = ModelRunner(tiny_llama_dir, RunnerConfig(num_kv_blocks=40, block_size=16, attention_backend="triton",
                                                          swap_space=0, max_num_seqs=8))
        runs = []
        if mode == "piecewise":
            runner.piecewise = PiecewiseGraphs(runner.model.model, runner.kv_caches, [8, 16, 32], runner.device)
            runner.piecewise.capture()
            run = runner.piecewise.run
            runner.piecewise.run = lambda size, ids, *a: runs.append((size, ids.shape[0])) or run(size, ids, *a)
        drv = PlanDriver(runner, 16, 40, seed=0)
        for rid, prompt in prompts.items():
            drv.add(rid, prompt)
        for step in schedule:
            drv.step(step)
        results[mode] = ({rid: drv.outputs(rid) for rid in prompts}, [c.clone() for c in runner.kv_caches], runs)
    (eager_tokens, eager_kv, _), (tokens, kv, runs) = results["eager"], results["piecewise"]
    assert runs == [(32, 31), (32, 26), (32, 18), (8, 3)]
    assert tokens == eager_tokens and [len(t) for t in tokens.values()] == [4, 4, 2]
    for got, want in zip(kv, eager_kv):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # padding rows stored nothing
