"""The engine without the network: the scheduler core and a model runner in one
process, driven by the same loop as the services (schedule -> execute -> update).

Used for offline batch generation and as the benchmark's in-process baseline, so the
cost of the gRPC split can be measured against it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmserve.contract.outputs import RequestOutput
from llmserve.contract.plan import StepPlan
from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.scheduler import Scheduler, SchedulerConfig


@dataclass
class StepRecord:
    """What one step did, for benchmark figures."""

    seconds: float
    num_scheduled_tokens: int
    num_sampled: int
    num_seqs: int
    live_tokens: int  # Slots holding computed tokens of running sequences (shared blocks once).
    allocated_slots: int  # Blocks in use x block size after the step.
    # Slots of the blocks holding at least one live token: the least any allocator with
    # this block size needs for these sequences (live / this = the granularity bound).
    live_block_slots: int = 0
    # Query-key pairs attention computed: a row with c cached and n new tokens adds
    # n*c + n(n+1)/2 (causal). For attention FLOPs in MFU.
    attention_pairs: int = 0
    kv_tokens_read: int = 0  # Cached tokens attention read (context of every scheduled row).


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""


class InProcessEngine:
    def __init__(self, runner, max_num_seqs: int = 256, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                 preemption_mode: str = "auto", num_scheduler_steps: int = 1):
        info = runner.info
        self.runner = runner
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=min(info.max_model_len, info.num_kv_blocks * info.block_size),
                block_size=info.block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                enable_prefix_caching=enable_prefix_caching,
                preemption_mode=preemption_mode,
                num_scheduler_steps=num_scheduler_steps,
            ),
            num_blocks=info.num_kv_blocks,
            eos_token_ids=info.eos_token_ids,
            num_cpu_blocks=info.num_cpu_blocks,
        )
        self.plans: list[StepPlan] = []  # Every plan executed (kept only with keep_plans).
        self.keep_plans = False
        self.steps: list[StepRecord] = []

    @classmethod
    def from_model_dir(cls, model_dir: Path, dtype: str = "float32", kv_cache_memory_bytes: int | None = None,
                       num_kv_blocks: int | None = None, swap_space_bytes: int = 0,
                       **scheduler_kwargs) -> "InProcessEngine":
        from llmserve.worker.model_runner import ModelRunner

        runner = ModelRunner(model_dir, dtype=dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
                             num_kv_blocks=num_kv_blocks, swap_space_bytes=swap_space_bytes,
                             max_num_batched_tokens=scheduler_kwargs.get("max_num_batched_tokens", 512))
        return cls(runner, **scheduler_kwargs)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    n: int = 1, priority: int = 0) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, sampling, n=n, priority=priority)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, apply. Returns this step's outputs."""
        start = time.perf_counter()
        plan: StepPlan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.runner.execute(plan)
        if self.keep_plans:
            self.plans.append(plan)
        outputs = self.scheduler.update_from_output(plan, result)
        seconds = time.perf_counter() - start
        # NOTE: a multi-step plan is recorded as the decode steps it ran (time shared
        # equally): per-step FLOPs, bytes and batch sizes stay what the benchmark sums.
        slots = self._live_slots()
        for substep in range(result.num_steps):
            self.steps.append(self._record(plan, len(result.sampled) // result.num_steps,
                                           seconds / result.num_steps, slots, substep))
        return outputs

    def _live_slots(self) -> tuple[int, int]:
        """Physical slots holding computed tokens of running sequences, and the slots of
        the blocks holding them; a block shared by several sequences (prefix cache,
        n > 1) counts once."""
        kv, filled = self.scheduler.kv, {}
        for sample in self.scheduler.running:
            for i, block in enumerate(kv.get_block_ids(sample)):
                n = min(kv.block_size, sample.num_computed_tokens - i * kv.block_size)
                if n > 0:
                    filled[block] = max(filled.get(block, 0), n)
        return sum(filled.values()), len(filled) * kv.block_size

    def _record(self, plan: StepPlan, num_sampled: int, seconds: float, slots: tuple[int, int],
                substep: int = 0) -> StepRecord:
        """`slots`: _live_slots() after the plan; `substep`: which step of a multi-step plan
        (each row's context is one longer per step)."""
        sched = self.scheduler
        live, live_block_slots = slots
        used_blocks = sched.kv.num_total_blocks - sched.kv.num_free_blocks
        rows = [(r.num_computed_tokens + substep, r.num_scheduled_tokens)
                for r in plan.new_requests + plan.cached_requests]
        return StepRecord(
            attention_pairs=sum(n * c + n * (n + 1) // 2 for c, n in rows),
            kv_tokens_read=sum(c for c, _ in rows),
            seconds=seconds,
            num_scheduled_tokens=plan.total_scheduled_tokens,
            num_sampled=num_sampled,
            num_seqs=len(plan.new_requests) + len(plan.cached_requests),
            live_tokens=live,
            live_block_slots=live_block_slots,
            allocated_slots=used_blocks * sched.kv.block_size,
        )

    def run(self, requests: list[tuple[str, list[int], SamplingParams]],
            on_output: Callable[[RequestOutput], None] | None = None) -> dict[str, Completion]:
        """Adds every request, steps until all finish, returns their completions."""
        completions = {}
        for request_id, prompt, sampling in requests:
            self.add_request(request_id, prompt, sampling)
            completions[request_id] = Completion(request_id, list(prompt))
        while self.scheduler.has_unfinished_requests():
            for out in self.step():
                done = completions[out.request_id]
                done.output_token_ids += out.new_token_ids
                if out.finished:
                    done.finish_reason = out.finish_reason.name.lower()
                if on_output is not None:
                    on_output(out)
        return completions
