"""The scheduling config a registered worker gets: --max-num-batched-tokens,
--max-num-seqs and --async-scheduling default to None ("by device"), resolved here from
the device the worker reports (the budget's rule is llmserve/contract/step_budget.py,
which the worker applies too; the pipelined loop is on for a GPU worker)."""

from __future__ import annotations

from dataclasses import replace

from llmserve.contract.step_budget import StepBudget, resolve_step_budget
from llmserve.contract.worker_info import WorkerInfo
from llmserve.scheduler.config import SchedulerConfig


def budget_for(config: SchedulerConfig, info: WorkerInfo) -> StepBudget:
    """The step budget `config` gives a worker whose registration says `info`."""
    # getattr: in-process engines take any runner with an `info`; one that predates the
    # device facts is a CPU runner.
    return resolve_step_budget(config.max_num_batched_tokens, config.max_num_seqs,
                               getattr(info, "device", "cpu"), getattr(info, "device_memory_bytes", 0))


def config_for(config: SchedulerConfig, info: WorkerInfo) -> tuple[SchedulerConfig, StepBudget]:
    """`config` with its step budget resolved for `info`'s device (a new instance: the
    service's own config stays "by device" for the next worker, which may differ)."""
    budget = budget_for(config, info)
    return replace(config, max_num_batched_tokens=budget.max_num_batched_tokens,
                   max_num_seqs=budget.max_num_seqs, async_scheduling=pipelined_for(config, info)), budget


def pipelined_for(config: SchedulerConfig, info: WorkerInfo) -> bool:
    """--async-scheduling as set, else on where the worker's device computes while the
    host plans (CUDA); off on the CPU, where both would share the same cores."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return getattr(info, "device", "cpu").startswith("cuda")


def on_cpu(config: SchedulerConfig) -> SchedulerConfig:
    """`config` as a CPU worker would get it (for cores built without a worker: tests)."""
    return config_for(config, WorkerInfo(model="", model_path="", num_kv_blocks=0, block_size=0, dtype="",
                                         max_model_len=0, vocab_size=0))[0]
