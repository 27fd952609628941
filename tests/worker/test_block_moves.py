"""The worker's swap-out / swap-in / copy-on-write copies move exactly the right blocks."""

from __future__ import annotations

import pytest
import torch

from llmserve.contract.plan import StepPlan
from llmserve.worker import kv_cache as kvc
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.config import RunnerConfig


def test_moves_run_in_order_and_touch_only_their_blocks(tiny_llama_dir):
    block_bytes = kvc.bytes_per_block(4, 2, 16, 3, torch.float32)
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=4, num_kv_blocks=8, swap_space=4 * block_bytes))
    assert runner.info.num_cpu_blocks == 4
    torch.manual_seed(0)
    for layer in runner.kv_caches + runner.cpu_kv_caches:
        layer.normal_()
    gpu = [t.clone() for t in runner.kv_caches]
    cpu = [t.clone() for t in runner.cpu_kv_caches]
    # swap-out 1->c0 and 2->c3, then swap-in c0->5 (the block just swapped out), then copy 2->7.
    runner.execute(StepPlan(0, swap_out=[(1, 0), (2, 3)], swap_in=[(0, 5)], copies=[(2, 7)]))
    for layer in range(3):
        new_gpu, new_cpu = runner.kv_caches[layer], runner.cpu_kv_caches[layer]
        assert torch.equal(new_cpu[:, 0], gpu[layer][:, 1])
        assert torch.equal(new_cpu[:, 3], gpu[layer][:, 2])
        assert torch.equal(new_gpu[:, 5], gpu[layer][:, 1])
        assert torch.equal(new_gpu[:, 7], gpu[layer][:, 2])
        for b in (0, 1, 2, 3, 4, 6):
            assert torch.equal(new_gpu[:, b], gpu[layer][:, b]), b
        for b in (1, 2):
            assert torch.equal(new_cpu[:, b], cpu[layer][:, b]), b


def test_out_of_range_moves_are_rejected(tiny_llama_dir):
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(block_size=4, num_kv_blocks=8, swap_space=0))
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


def test_block_mover_runs_consecutive_blocks_as_one_copy_and_reads_sources_first():
    assert kvc.contiguous_runs([(3, 7), (4, 8), (5, 9), (9, 1), (10, 3)]) == [(3, 7, 3), (9, 1, 1), (10, 3, 1)]
    caches = [torch.randn(2, 8, 4, 2, 4) for _ in range(3)]
    before = [c.clone() for c in caches]
    kvc.BlockMover(caches, []).run([], [], [(1, 5), (5, 2), (7, 0)])  # 5 is read before it is written
    for c, b in zip(caches, before):
        assert torch.equal(c[:, 5], b[:, 1]) and torch.equal(c[:, 2], b[:, 5]) and torch.equal(c[:, 0], b[:, 7])
        assert torch.equal(c[:, [1, 3, 4, 6, 7]], b[:, [1, 3, 4, 6, 7]])
