"""The worker's swap-out / swap-in / copy-on-write copies move exactly the right blocks, on
the CPU and (marked gpu) on CUDA, where swaps are asynchronous copies on a side stream
between the device cache and a pinned host pool."""

from __future__ import annotations

import pytest
import torch

from llmserve.contract.plan import StepPlan
from llmserve.worker import kv_cache as kvc
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.config import RunnerConfig

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")])]

# Blocks of 4 tokens keep the cases small; the Triton backend (auto's choice on CUDA) only
# runs blocks of 16 and more, and attention is not what these tests exercise.
BACKEND = "torch"


def _runner(model_dir, device: str, num_cpu_blocks: int) -> ModelRunner:
    block_bytes = kvc.bytes_per_block(4, 2, 16, 3, torch.float32)
    runner = ModelRunner(model_dir, RunnerConfig(device=device, dtype="float32", block_size=4, num_kv_blocks=8,
                                                 swap_space=num_cpu_blocks * block_bytes, enforce_eager=True,
                                                 attention_backend=BACKEND))
    assert runner.info.num_cpu_blocks == num_cpu_blocks
    assert all(c.device.type == device for c in runner.kv_caches)
    if device == "cuda":  # the host pool is pinned, and swaps take the side stream
        assert all(c.is_pinned() for c in runner.cpu_kv_caches) and runner.mover.stream is not None
    torch.manual_seed(0)
    for layer in runner.kv_caches + runner.cpu_kv_caches:
        layer.normal_()
    return runner


def _host(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies on the host, once every queued copy (the side stream's too) is done."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [c.cpu().clone() for c in caches]


@pytest.mark.parametrize("device", DEVICES)
def test_moves_run_in_order_and_touch_only_their_blocks(tiny_llama_dir, device):
    runner = _runner(tiny_llama_dir, device, 4)
    gpu = _host(runner.kv_caches)
    cpu = _host(runner.cpu_kv_caches)
    # swap-out 1->c0 and 2->c3, then swap-in c0->5 (the block just swapped out), then copy 2->7.
    runner.execute(StepPlan(0, swap_out=[(1, 0), (2, 3)], swap_in=[(0, 5)], copies=[(2, 7)]))
    after_gpu, after_cpu = _host(runner.kv_caches), _host(runner.cpu_kv_caches)
    for layer in range(3):
        new_gpu, new_cpu = after_gpu[layer], after_cpu[layer]
        assert torch.equal(new_cpu[:, 0], gpu[layer][:, 1])
        assert torch.equal(new_cpu[:, 3], gpu[layer][:, 2])
        assert torch.equal(new_gpu[:, 5], gpu[layer][:, 1])
        assert torch.equal(new_gpu[:, 7], gpu[layer][:, 2])
        for b in (0, 1, 2, 3, 4, 6):
            assert torch.equal(new_gpu[:, b], gpu[layer][:, b]), b
        for b in (1, 2):
            assert torch.equal(new_cpu[:, b], cpu[layer][:, b]), b


@pytest.mark.parametrize("device", DEVICES)
def test_runs_of_blocks_swap_out_and_back_in_intact(tiny_llama_dir, device):
    """Consecutive ids move as one copy each way; a later plan's swap-ins read what an
    earlier one swapped out, and its copies see the blocks swapped in."""
    runner = _runner(tiny_llama_dir, device, 6)
    gpu, cpu = _host(runner.kv_caches), _host(runner.cpu_kv_caches)
    runner.execute(StepPlan(0, swap_out=[(2, 1), (3, 2), (4, 3), (7, 0)]))  # a run of 3, and one more
    runner.execute(StepPlan(1, swap_in=[(1, 5), (2, 6), (3, 7), (0, 2)], copies=[(5, 3)]))  # no host sync between
    after_gpu, after_cpu = _host(runner.kv_caches), _host(runner.cpu_kv_caches)
    for layer in range(3):
        old, new = gpu[layer], after_gpu[layer]
        for dst, src in {5: 2, 6: 3, 7: 4, 2: 7, 3: 2, 0: 0, 1: 1, 4: 4}.items():
            assert torch.equal(new[:, dst], old[:, src]), (layer, dst)
        for c, src in {0: 7, 1: 2, 2: 3, 3: 4}.items():
            assert torch.equal(after_cpu[layer][:, c], old[:, src]), (layer, c)
        assert torch.equal(after_cpu[layer][:, 4:], cpu[layer][:, 4:])


def test_swap_copy_runs_move_what_move_blocks_moves():
    """The CUDA swap path's copies (BlockMover._copy_runs), checked on host tensors."""
    moves = [(3, 0), (4, 1), (5, 2), (0, 7), (6, 3), (7, 5)]
    src = [torch.randn(2, 8, 4, 2, 4) for _ in range(3)]
    want, got = [torch.zeros(2, 8, 4, 2, 4) for _ in range(3)], [torch.zeros(2, 8, 4, 2, 4) for _ in range(3)]
    kvc.move_blocks(src, want, moves)
    kvc.BlockMover._copy_runs(src, got, moves)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert kvc.contiguous_runs(moves) == [(3, 0, 3), (0, 7, 1), (6, 3, 1), (7, 5, 1)]


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_moves_are_rejected(tiny_llama_dir, device):
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(device=device, block_size=4, num_kv_blocks=8, swap_space=0,
                                                      enforce_eager=True, attention_backend=BACKEND))
    with pytest.raises(ValueError, match="swap-out"):
        runner.execute(StepPlan(0, swap_out=[(1, 0)]))  # No swap space.
    with pytest.raises(ValueError, match="copy"):
        runner.execute(StepPlan(1, copies=[(1, 8)]))


def test_kv_blocks_from_profiled_budget(tiny_llama_dir, caplog, monkeypatch):
    block_bytes = kvc.bytes_per_block(16, 2, 16, 3, torch.float32)
    monkeypatch.setattr(kvc, "default_kv_cache_bytes", lambda: 2**30)
    with caplog.at_level("INFO"):
        runner = ModelRunner(tiny_llama_dir, RunnerConfig(max_num_batched_tokens=300, swap_space=0))
    # The default budget less the measured activation peak.
    assert 0 < runner.num_kv_blocks <= 2**30 // block_bytes
    assert ModelRunner(tiny_llama_dir, RunnerConfig(kv_cache_memory=200 * block_bytes, swap_space=0)).num_kv_blocks == 200
    assert "# KV blocks:" in caplog.text and "max concurrency for 256-token requests" in caplog.text
    assert "300-token dummy forward" in caplog.text


@pytest.mark.parametrize("device", DEVICES)
def test_block_mover_runs_consecutive_blocks_as_one_copy_and_reads_sources_first(device):
    assert kvc.contiguous_runs([(3, 7), (4, 8), (5, 9), (9, 1), (10, 3)]) == [(3, 7, 3), (9, 1, 1), (10, 3, 1)]
    caches = [torch.randn(2, 8, 4, 2, 4, device=device) for _ in range(3)]
    before = _host(caches)
    kvc.BlockMover(caches, []).run([], [], [(1, 5), (5, 2), (7, 0)])  # 5 is read before it is written
    for c, b in zip(_host(caches), before):
        assert torch.equal(c[:, 5], b[:, 1]) and torch.equal(c[:, 2], b[:, 5]) and torch.equal(c[:, 0], b[:, 7])
        assert torch.equal(c[:, [1, 3, 4, 6, 7]], b[:, [1, 3, 4, 6, 7]])
