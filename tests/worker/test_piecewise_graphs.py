"""Piecewise graphs (piecewise_graphs.py) for steps that mix prefill chunks with decodes:
the pieces over their static buffers, padded to the token ladder, against eager steps of
the same runner. On the CPU the pieces run as plain calls (EagerPieces); on CUDA
(`-m gpu`) as captured graphs, and a mixed step launches without a host sync."""

from __future__ import annotations

import pytest
import torch

from llmserve.worker.config import RunnerConfig
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.piecewise_graphs import PiecewiseGraphs, rotate_and_store, token_ladder
from tests.tiny_models import make_tiny_model, make_tiny_window_model
from tests.worker.conftest import PlanDriver

BLOCK, BLOCKS = 16, 48
ON_CUDA = torch.cuda.is_available()

# Token counts of the steps below: 31 (prefills: r0, r1), 26 (2 decodes + r2's first chunk),
# 25 (2 decodes + r2's second chunk over its cached 24 + r3's prefill), 4 (decodes), then
# 48 (r4's prefill + 3 decodes): past the ladder, eager.
PROMPTS = {"r0": list(range(3, 23)), "r1": list(range(40, 51)), "r2": list(range(60, 100)),
           "r3": list(range(120, 127)), "r4": list(range(150, 195))}
SCHEDULE = [{"r0": None, "r1": None}, {"r0": None, "r1": None, "r2": 24},
            {"r0": None, "r1": None, "r2": None, "r3": None}, {"r0": None, "r1": None, "r2": None, "r3": None},
            {"r0": None, "r1": None, "r2": None, "r4": None}]
LADDER = [8, 16, 32]
RUNS = [(32, 31), (32, 26), (32, 25), (8, 4)]  # (size, tokens) of each piecewise run; the 48-token step: none


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral", "gemma2"])
def model_dir(request, tmp_path_factory):
    """Llama; Qwen3 (qk norms); Mistral (every layer windowed, 8 tokens: the chunks' cached
    context leaves the window); Gemma 2 (sandwich norms, soft-caps, alternating windows)."""
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return make_tiny_model(out, "llama", tied=True)
    return make_tiny_window_model(out, request.param)


def test_token_ladder():
    assert token_ladder(512) == [8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert token_ladder(8192) == token_ladder(512)  # vLLM's capture ceiling
    assert token_ladder(300) == [8, 16, 32, 64, 128, 192, 256, 300]
    assert token_ladder(20) == [8, 16, 20]


def _drive(model_dir, device: str, piecewise: bool, runs: list, monkeypatch, **settings):
    runner = ModelRunner(model_dir, RunnerConfig(device=device, num_kv_blocks=BLOCKS, block_size=BLOCK, swap_space=0,
                                                 max_num_seqs=8, **settings))
    if piecewise and runner.piecewise is None:  # the CPU: no graphs of its own
        runner.piecewise = PiecewiseGraphs(runner.model.model, runner.kv_caches, LADDER, runner.device)
        runner.piecewise.capture()
    if piecewise:
        run = PiecewiseGraphs.run
        monkeypatch.setattr(PiecewiseGraphs, "run",
                            lambda self, size, ids, *a: runs.append((size, ids.shape[0])) or run(self, size, ids, *a))
    drv = PlanDriver(runner, BLOCK, BLOCKS, seed=0)
    for rid, prompt in PROMPTS.items():
        drv.add(rid, prompt)
    for schedule in SCHEDULE:
        drv.step(schedule)
    return {rid: drv.outputs(rid) for rid in PROMPTS}, [c.float().cpu() for c in runner.kv_caches], runner


def test_mixed_steps_through_the_pieces_equal_eager_steps(model_dir, monkeypatch):
    """Prefills, chunks with and without cached context, decodes, padded to 8 and 32
    tokens: the same tokens and KV cache as eager steps (padding rows store nothing: any
    slot they wrote would differ), and the step past the ladder runs eagerly."""
    eager_tokens, eager_kv, _ = _drive(model_dir, "cpu", False, [], monkeypatch)
    runs = []
    tokens, kv, _ = _drive(model_dir, "cpu", True, runs, monkeypatch)
    assert runs == RUNS
    assert tokens == eager_tokens
    assert [len(t) for t in tokens.values()] == [5, 5, 3, 2, 1]
    for got, want in zip(kv, eager_kv):
        # (a GEMM of 32 rows may round differently from one of 25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padding_rows_store_no_keys():
    """rotate_and_store's slot -1 rows (the pieces' padding) leave the cache as it was,
    on the fused CPU pass and on the torch fallback alike."""
    torch.manual_seed(0)
    H, KVH, D = 4, 2, 16
    cache = torch.randn(2, 4, BLOCK, KVH, D)
    slots = torch.tensor([5, 17, -1, -1])
    positions = torch.tensor([5, 17, 0, 0])
    from llmserve.worker.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(D, 64, {"rope_type": "default", "rope_theta": 10000.0})(positions)
    for fallback in (False, True):
        got = cache.clone()
        # A strided cache is not the fused pass's: the torch fallback stores.
        target = got.transpose(3, 4).contiguous().transpose(3, 4) if fallback else got
        qkv = torch.randn(4, (H + 2 * KVH) * D)
        _, k, v = rotate_and_store(qkv, rope, target, slots, H, KVH, D)
        flat = target.reshape(2, -1, KVH, D)
        assert torch.equal(flat[0, [5, 17]], k[:2]) and torch.equal(flat[1, [5, 17]], v[:2])
        untouched = [s for s in range(flat.shape[1]) if s not in (5, 17)]
        assert torch.equal(flat[:, untouched], cache.reshape(2, -1, KVH, D)[:, untouched])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_mixed_steps_through_cuda_graphs_equal_eager_steps(model_dir, monkeypatch):
    """The same steps on CUDA, the runner's own captured pieces (ladder up to its 64-token
    budget) against --enforce-eager, in float32 (GEMMs of other row counts differ in
    rounding only): the same tokens, the same KV cache up to that rounding."""
    settings = dict(max_num_batched_tokens=64, dtype="float32")
    eager_tokens, eager_kv, _ = _drive(model_dir, "cuda", False, [], monkeypatch, enforce_eager=True, **settings)
    runs = []
    tokens, kv, runner = _drive(model_dir, "cuda", True, runs, monkeypatch, **settings)
    assert runner.piecewise.sizes == [8, 16, 32, 64]
    # (the 4-decode step is the decode graphs'; 48 tokens fit this ladder)
    assert runs == [(32, 31), (32, 26), (32, 25), (64, 48)]
    assert tokens == eager_tokens
    for got, want in zip(kv, eager_kv):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_a_mixed_step_launches_without_a_host_sync(tiny_llama_dir):
    """A mixed step (a prefill chunk + decodes, greedy and random rows) through the
    runner's launch under torch.cuda.set_sync_debug_mode("error"): inputs, piecewise
    graphs, LM head and sampling wait for the device nowhere (finish's read back of the
    ids is the step's one wait, outside)."""
    from llmserve.contract.sampling import SamplingParams

    runner = ModelRunner(tiny_llama_dir, RunnerConfig(device="cuda", num_kv_blocks=BLOCKS, block_size=BLOCK,
                                                      swap_space=0, max_num_seqs=8, max_num_batched_tokens=64))
    drv = PlanDriver(runner, BLOCK, BLOCKS, seed=0)
    drv.add("a", list(range(3, 23)))
    drv.add("b", list(range(40, 51)), SamplingParams(temperature=1.0, top_p=0.9, top_k=20))
    drv.add("c", list(range(60, 100)))
    drv.step({"a": None, "b": None})  # first contact: compiles, and whatever the first step may sync
    launch, runs = runner.launch, []

    def checked(plan):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = checked
    run = runner.piecewise.run
    runner.piecewise.run = lambda size, ids, *a: runs.append(size) or run(size, ids, *a)
    drv.step({"a": None, "b": None, "c": 24})
    assert runs == [32]
    assert len(drv.outputs("a")) == len(drv.outputs("b")) == 2
