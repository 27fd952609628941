"""Device-sized steps (issue 31, item 2): the step budget follows the device the worker
reports at registration, an explicit setting wins, the choice is logged and reported."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from types import SimpleNamespace

import pytest

from llmserve.contract.step_budget import StepBudget, resolve_step_budget
from llmserve.contract.wire import worker_info_from_pb, worker_info_to_pb
from llmserve.contract.worker_info import WorkerInfo
from llmserve.scheduler.config import SchedulerConfig, SchedulerServiceConfig
from llmserve.scheduler.engine_session import core_for
from llmserve.scheduler.step_budget import config_for, on_cpu
from llmserve.settings import add_flags, options, resolve

GIB = 2**30
H100 = "cuda (NVIDIA H100 80GB HBM3)"


def worker(device: str = "cpu", memory: int = 0) -> WorkerInfo:
    return WorkerInfo(model="m", model_path="/m", num_kv_blocks=64, block_size=16, dtype="bfloat16",
                      max_model_len=4096, vocab_size=1000, device=device, device_memory_bytes=memory)


@pytest.mark.parametrize("device, memory, expected", [
    ("cpu", 0, (512, 256)),  # Today's values.
    (H100, 80 * GIB, (16384, 1024)),  # vLLM's large-card defaults (offline usage).
    ("cuda (NVIDIA H200)", 140 * GIB, (16384, 1024)),
    ("cuda (NVIDIA GeForce RTX 4090)", 24 * GIB, (8192, 256)),  # A smaller card.
    ("cuda (NVIDIA A100-SXM4-80GB)", 80 * GIB, (8192, 256)),  # vLLM leaves the A100 out (PR #17885).
    ("cuda (NVIDIA L40S)", 69 * GIB, (8192, 256)),  # Just under the 70 GiB line.
    (H100, 0, (8192, 256)),  # Memory unknown: the smaller card's defaults, not the large ones.
])
def test_by_device(device, memory, expected):
    config, budget = config_for(SchedulerConfig(), worker(device, memory))
    assert (config.max_num_batched_tokens, config.max_num_seqs) == expected
    assert (budget.max_num_batched_tokens, budget.max_num_seqs) == expected
    assert budget.reason.startswith("by device: ")


def test_an_explicit_setting_wins_on_any_device():
    for info in (worker(), worker(H100, 80 * GIB)):
        config, budget = config_for(SchedulerConfig(max_num_seqs=7, max_num_batched_tokens=300), info)
        assert (config.max_num_batched_tokens, config.max_num_seqs) == (300, 7)
        assert budget.reason == "set by --max-num-batched-tokens and --max-num-seqs"
    # One set, the other by device.
    config, budget = config_for(SchedulerConfig(max_num_seqs=64), worker(H100, 80 * GIB))
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (16384, 64)
    assert budget.reason == f"set by --max-num-seqs, the other by device: {H100}, 80.0 GiB"


def test_the_service_config_stays_by_device_for_the_next_worker():
    config = SchedulerConfig()
    resolved, _ = config_for(config, worker(H100, 80 * GIB))
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (None, None)  # A new instance.
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.max_num_seqs = 1  # type: ignore[misc]
    # A CPU worker registering next gets the CPU's budget, not the card's.
    assert config_for(config, worker())[0].max_num_seqs == 256
    assert on_cpu(config).max_num_batched_tokens == 512


def test_flags_env_and_file_set_it(tmp_path):
    flags = resolve(SchedulerServiceConfig, {"max_num_seqs": 9}, environ={})
    env = resolve(SchedulerServiceConfig, environ={"LLMSERVE_MAX_NUM_BATCHED_TOKENS": "2048"})
    (tmp_path / "c.yaml").write_text("max-num-seqs: 5\n")
    file = resolve(SchedulerServiceConfig, environ={}, file=tmp_path / "c.yaml")
    assert config_for(flags.scheduling, worker(H100, 80 * GIB))[0].max_num_seqs == 9
    assert config_for(env.scheduling, worker(H100, 80 * GIB))[0].max_num_batched_tokens == 2048
    assert config_for(file.scheduling, worker(H100, 80 * GIB))[0].max_num_seqs == 5
    default = resolve(SchedulerServiceConfig, environ={})
    assert config_for(default.scheduling, worker(H100, 80 * GIB))[0].max_num_seqs == 1024


def test_registration_logs_the_choice_once(caplog):
    with caplog.at_level(logging.INFO, logger="llmserve.scheduler.engine_session"):
        core = core_for(SchedulerServiceConfig(), worker(H100, int(79.6 * GIB)))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step budget")]
    assert lines == [f"step budget: 16384 batched tokens, 1024 sequences (by device: {H100}, 79.6 GiB); "
                     "engine loop: pipelined (by device)"]
    # The core plans with the resolved budget.
    assert (core.config.max_num_batched_tokens, core.config.max_num_seqs) == (16384, 1024)
    assert core.queues.max_num_seqs == 1024
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmserve.scheduler.engine_session"):
        core_for(SchedulerServiceConfig(scheduling=SchedulerConfig(max_num_seqs=32)), worker())
    assert ("step budget: 512 batched tokens, 32 sequences (set by --max-num-seqs, the other by device: cpu); "
            "engine loop: serial (by device)") in [r.getMessage() for r in caplog.records]


def test_the_worker_reports_its_device_memory_over_the_wire():
    info = worker(H100, 80 * GIB)
    assert worker_info_from_pb(worker_info_to_pb(info)) == info
    assert worker_info_from_pb(worker_info_to_pb(worker())).device_memory_bytes == 0


def test_model_info_reports_the_budget():
    from llmserve.router.service import _model_info

    info = worker(H100, 80 * GIB)
    served = SimpleNamespace(name="m", max_model_len=4096, vocab_size=1000)
    budget = resolve_step_budget(None, None, info.device, info.device_memory_bytes)
    public = _model_info(served, info, 64, SimpleNamespace(eos_token_ids=[]), budget=budget)
    assert (public.max_num_batched_tokens, public.max_num_seqs) == (16384, 1024)
    assert public.step_budget_reason == f"by device: {H100}, 80.0 GiB"
    # A scheduler that predates the budget: zeros, not a guess.
    old = _model_info(served, info, 64, SimpleNamespace(eos_token_ids=[]))
    assert (old.max_num_batched_tokens, old.max_num_seqs, old.step_budget_reason) == (0, 0, "")


def test_describe_is_the_log_line():
    assert StepBudget(512, 256, "by device: cpu").describe() == (
        "step budget: 512 batched tokens, 256 sequences (by device: cpu)")


def test_the_pipelined_loop_is_on_for_a_gpu_worker_and_off_on_the_cpu_unless_set():
    """--async-scheduling is `bool | None`: unset (None) resolves by device at registration;
    either flag, its variable or a file key wins."""
    default = resolve(SchedulerServiceConfig, environ={}).scheduling
    assert default.async_scheduling is None
    assert config_for(default, worker(H100, 80 * GIB))[0].async_scheduling is True
    assert config_for(default, worker())[0].async_scheduling is False
    parser = argparse.ArgumentParser()
    add_flags(parser, SchedulerServiceConfig)
    off = resolve(SchedulerServiceConfig, parser.parse_args(["--no-async-scheduling"]), environ={}).scheduling
    assert config_for(off, worker(H100, 80 * GIB))[0].async_scheduling is False
    on = resolve(SchedulerServiceConfig, environ={"LLMSERVE_ASYNC_SCHEDULING": "1"}).scheduling
    assert config_for(on, worker())[0].async_scheduling is True
    (option,) = [o for o in options(SchedulerServiceConfig) if o.name == "async-scheduling"]
    assert option.is_bool and option.shown_default == "by device: on for a GPU worker, off on the CPU"
