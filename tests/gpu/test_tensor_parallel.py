"""Tensor parallelism over NCCL: two worker ranks, one GPU each, give the tokens of one
rank alone, eagerly and through CUDA graphs (the TP all-reduces inside the captured
decode). Needs two GPUs; skipped with a reason on a host that shows fewer."""

from __future__ import annotations

import pickle
import traceback

import pytest
import torch

from tests.parallel.harness import spawn_ranks

from .conftest import DEVICE, GPU, ON_CUDA

pytestmark = GPU

BLOCK = 16
NUM_BLOCKS = 32


def _scenario(runner) -> tuple[list[int], list[int]]:
    """Chunked prefill, decodes of 2 rows, multi-step runs; greedy."""
    from tests.worker.conftest import PlanDriver

    d = PlanDriver(runner, BLOCK, NUM_BLOCKS)
    d.add("a", [5, 6, 7, 8, 9])
    d.add("b", list(range(20, 53)))  # 33 tokens: a chunk of 20, then 13
    d.step({"a": None, "b": 20})
    d.step({"a": 1, "b": None})
    for _ in range(4):
        d.step({"a": 1, "b": 1})
    assert d.step({"a": 1, "b": 1}, num_steps=3).num_steps == 3
    assert d.step({"a": 1}, num_steps=2).num_steps == 2
    return d.outputs("a"), d.outputs("b")


def _runner(model_dir: str, device: str, enforce_eager: bool, dist=None):
    from llmserve.worker.config import RunnerConfig
    from llmserve.worker.model_runner import ModelRunner

    return ModelRunner(model_dir, RunnerConfig(
        device=device, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, swap_space=0, max_num_seqs=4,
        max_num_batched_tokens=64, enforce_eager=enforce_eager), dist=dist)


def _rank(rank: int, tp: int, pp: int, port: int, model_dir: str, device: str, enforce_eager: bool, queue) -> None:
    """Spawned: one rank of the group runs the scenario."""
    try:
        torch.set_num_threads(1)
        from llmserve.worker.distributed import DistInit, shutdown_parallel

        runner = _runner(model_dir, device, enforce_eager, DistInit(tp, pp, rank, f"tcp://127.0.0.1:{port}"))
        out = (*_scenario(runner), str(runner.device), runner.graphs is not None, runner.parallel.tp.size)
        queue.put((rank, pickle.dumps(out), None))
        shutdown_parallel(runner.parallel)
    except BaseException:  # noqa: BLE001 - reported to the parent test
        queue.put((rank, None, traceback.format_exc()))


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_tp2_over_nccl_equals_tp1(gpu_models, enforce_eager):
    if ON_CUDA and torch.cuda.device_count() < 2:
        pytest.skip(f"TP=2 needs 2 GPUs; this host shows {torch.cuda.device_count()}")
    model_dir = str(gpu_models["qwen2"])  # q/k/v biases sharded with their heads; 2 KV heads, one per rank
    want = _scenario(_runner(model_dir, DEVICE.type, enforce_eager))
    assert len(want[0]) == 1 + 1 + 4 + 3 + 2 and len(want[1]) == 1 + 4 + 3
    got = spawn_ranks(_rank, 2, 1, model_dir, DEVICE.type, enforce_eager)
    for rank, (a, b, device, graphs, tp) in got.items():
        assert (a, b) == want, f"rank {rank}"
        assert tp == 2 and device == (f"cuda:{rank}" if ON_CUDA else "cpu")
        assert graphs == (ON_CUDA and not enforce_eager)
