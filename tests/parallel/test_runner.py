"""The worker's ModelRunner as a TP/PP group member (spawned ranks, gloo), driven by
scheduler-style plans (new requests in full, then deltas; chunked prefill; multi-step
runs, interrupted on some ranks): every rank ends with the TP=1 runner's tokens and steps, the block count is the minimum over ranks, and
GetModelInfo's tensor_parallel_size is T."""

from __future__ import annotations

import pickle
import traceback

import pytest
import torch

from .harness import spawn_ranks


def _drive(rank: int, tp: int, pp: int, port: int, model_dir: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        from llmserve.worker.distributed import DistInit
        from llmserve.worker.model_runner import ModelRunner
        from llmserve.worker.config import RunnerConfig
        from tests.worker.conftest import PlanDriver

        dist = DistInit(tp, pp, rank, f"tcp://127.0.0.1:{port}") if tp * pp > 1 else None
        # Ranks get different budgets: all must allocate the smallest block count.
        runner = ModelRunner(model_dir, RunnerConfig(block_size=4, kv_cache_memory=2**20 * (rank + 1), max_num_batched_tokens=32, swap_space=0), dist=dist)
        drv = PlanDriver(runner, 4, runner.num_kv_blocks)
        drv.add("a", [5, 6, 7, 8, 9])
        drv.add("b", list(range(20, 33)))
        drv.step({"a": None, "b": 7})  # b: first chunk
        drv.step({"a": 1, "b": None})
        for _ in range(5):
            drv.step({"a": 1, "b": 1})
        # Multi-step runs. An interrupt reaches the ranks at different moments, so the
        # driver's decides for all: one on the other ranks alone changes nothing.
        runs = [drv.step({"a": 1, "b": 1}, num_steps=3).num_steps]
        if not runner.parallel.is_driver:
            runner.interrupt(drv.step_id)
        runs.append(drv.step({"a": 1, "b": 1}, num_steps=3).num_steps)
        if runner.parallel.is_driver:
            runner.interrupt(drv.step_id)
        runs.append(drv.step({"a": 1, "b": 1}, num_steps=3).num_steps)
        out = (drv.outputs("a"), drv.outputs("b"), runner.num_kv_blocks, runner.info.tensor_parallel_size,
               [tuple(c.shape) for c in runner.kv_caches], runs)
        queue.put((rank, pickle.dumps(out), None))
    except BaseException:  # noqa: BLE001
        queue.put((rank, None, traceback.format_exc()))


@pytest.fixture(scope="module")
def runner_model(parallel_models):
    return str(parallel_models["qwen2_kv1"])  # 3 layers, 1 KV head, q/k/v biases


def test_runner_groups_match_tp1(runner_model):
    ref = spawn_ranks(_drive, 1, 1, runner_model)[0]
    assert ref[3] == 1 and len(ref[4]) == 3
    assert ref[5] == [3, 3, 1] and len(ref[0]) == 1 + 1 + 5 + 7
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        got = spawn_ranks(_drive, tp, pp, runner_model)
        for rank, out in got.items():
            assert out[:2] == ref[:2], f"tp={tp} pp={pp} rank {rank}"
            assert out[5] == ref[5], f"tp={tp} pp={pp} rank {rank}: steps run"
            assert out[3] == tp
            stage = rank // tp
            assert len(out[4]) == (stage + 1) * 3 // pp - stage * 3 // pp  # its own layers only
            assert out[4][0][3] == 1  # one (replicated) KV head per rank
        assert len({out[2] for out in got.values()}) == 1  # one block count for the group
        # The smallest budget (rank 0's 1 MiB) over the largest per-block size decides.
        per_block = {r: 2 * 4 * 1 * 16 * len(o[4]) * 4 for r, o in got.items()}  # K+V, 4 slots, 1 head of 16
        assert got[0][2] == min((2**20 * (r + 1)) // b for r, b in per_block.items())


def _drive_ahead(rank: int, tp: int, pp: int, port: int, model_dir: str, queue) -> None:
    """The mixed workload of tests/worker/test_pipelined_runner.py, each plan launched
    before the one before is finished (TP=1: executed one by one, the reference)."""
    try:
        torch.set_num_threads(1)
        from llmserve.worker.distributed import DistInit
        from llmserve.worker.model_runner import ModelRunner
        from llmserve.worker.config import RunnerConfig
        from tests.worker.test_pipelined_runner import mixed_workload, run_pipelined, tokens

        dist = DistInit(tp, pp, rank, f"tcp://127.0.0.1:{port}") if tp * pp > 1 else None
        runner = ModelRunner(model_dir, RunnerConfig(block_size=4, num_kv_blocks=96, max_model_len=128,
                                                     max_num_batched_tokens=64, swap_space=0),
                             sampler_seed=3, dist=dist)
        plans = mixed_workload().plans
        if dist is None:
            results, ahead = [runner.execute(plan) for plan in plans], []
        else:
            results, ahead = run_pipelined(runner, plans)
        states = {sid: st.token_ids for sid, st in runner.batch.states.items()}
        queue.put((rank, pickle.dumps(([tokens(r) for r in results], ahead, states)), None))
    except BaseException:  # noqa: BLE001
        queue.put((rank, None, traceback.format_exc()))


def test_a_group_launching_ahead_keeps_the_serial_tokens(runner_model):
    """Every rank fills its placeholders from its own copy of the driver's broadcast ids."""
    ref_tokens, _, ref_states = spawn_ranks(_drive_ahead, 1, 1, runner_model)[0]
    got = spawn_ranks(_drive_ahead, 2, 2, runner_model)
    for rank, (step_tokens, ahead, states) in got.items():
        assert step_tokens == ref_tokens, f"rank {rank}"
        assert all(ahead) and states == ref_states, f"rank {rank}"
