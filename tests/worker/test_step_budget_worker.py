"""The worker's side of device-sized steps: it sizes its profiling forward and its
CUDA-graph ladder by the scheduler's rule (contract/step_budget.py), from the facts it
reports at registration."""

from __future__ import annotations

import torch

from llmserve.contract.step_budget import resolve_step_budget
from llmserve.worker.config import RunnerConfig
from llmserve.worker.cuda_graphs import capture_sizes
from llmserve.worker.model_runner import ModelRunner, device_facts


def test_the_ladder_reaches_the_sequence_cap():
    # The CPU / smaller-card cap: 1, 2, 4 and every multiple of 8 up to 256, as before.
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    large = capture_sizes(1024)
    assert large[-1] == 1024 and set(range(8, 257, 8)) <= set(large)
    # Past 256 the sizes are wider apart, but a batch never pads by more than 1/16.
    for batch in range(1, 1025):
        padded = next(s for s in large if s >= batch)
        assert padded - batch <= max(7, batch // 16), batch
    assert len(large) < 70  # Not 131 graphs at a stride of 8.
    # A cap off the ladder is captured itself; a tiny one stays tiny.
    assert capture_sizes(300)[-2:] == [288, 300] and capture_sizes(3) == [1, 2, 3]


def test_cpu_facts():
    assert device_facts(torch.device("cpu")) == ("cpu", 0)


def test_the_runner_sizes_steps_as_the_scheduler_will(tiny_llama_dir):
    runner = ModelRunner(tiny_llama_dir, RunnerConfig(device="cpu", num_kv_blocks=16, swap_space=0))
    info = runner.info
    scheduler_side = resolve_step_budget(None, None, info.device, info.device_memory_bytes)
    assert (runner.settings.max_num_batched_tokens, runner.settings.max_num_seqs) == (512, 256)
    assert (scheduler_side.max_num_batched_tokens, scheduler_side.max_num_seqs) == (512, 256)
    assert info.device == "cpu" and info.device_memory_bytes == 0
    explicit = ModelRunner(tiny_llama_dir, RunnerConfig(device="cpu", num_kv_blocks=16, swap_space=0,
                                                        max_num_seqs=8, max_num_batched_tokens=64),
                           model=runner.model)
    assert (explicit.settings.max_num_batched_tokens, explicit.settings.max_num_seqs) == (64, 8)
