"""What each step of the in-process engine did, recorded by the benchmark around it.

`RecordingEngine` is the product's InProcessEngine with a recorder on the outside: it
times each `step()`, sees the plan the step ran and its result (through a thin wrapper
of the model runner) and reads the scheduler's block tables after it. The engine itself
keeps no record of its steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from llmserve.bench.clock import now
from llmserve.contract.outputs import RequestOutput
from llmserve.contract.plan import StepPlan, StepResult
from llmserve.launcher.engine import InProcessEngine
from llmserve.scheduler.config import SchedulerConfig


@dataclass
class StepRecord:
    """What one step did, for benchmark figures (MFU, roofline, KV utilisation)."""

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


class PlanTap:
    """A model runner that remembers the last plan whose result was read (executed, or
    launched and finished: the pipelined engine's step reads back at most one) and that
    result; every other attribute is the wrapped runner's."""

    def __init__(self, runner):
        self.runner = runner
        self.last: tuple[StepPlan, StepResult] | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.runner.execute(plan)
        self.last = (plan, result)
        return result

    def finish(self, launched) -> StepResult:
        result = self.runner.finish(launched)
        self.last = (launched.plan, result)
        return result

    def __getattr__(self, name):
        return getattr(self.runner, name)


class RecordingEngine(InProcessEngine):
    """InProcessEngine recording a StepRecord per step it runs (in `steps`)."""

    def __init__(self, runner, config: SchedulerConfig = SchedulerConfig()):
        super().__init__(runner if isinstance(runner, PlanTap) else PlanTap(runner), config)
        self.steps: list[StepRecord] = []

    def step(self) -> list[RequestOutput]:
        tap = self.runner
        tap.last = None
        device = getattr(tap.runner, "device", None)  # A test's stand-in runner may have none: the CPU.
        start = now(device)
        outputs = super().step()
        seconds = now(device) - start
        if tap.last is not None:
            self.steps += step_records(self.scheduler, *tap.last, seconds)
        return outputs


def live_slots(scheduler) -> tuple[int, int]:
    """Physical slots holding computed tokens of running sequences, and the slots of the
    blocks holding them; a block shared by several sequences (prefix cache, n > 1)
    counts once."""
    kv, filled = scheduler.kv, {}
    for sample in scheduler.running:
        for i, block in enumerate(kv.get_block_ids(sample)):
            n = min(kv.block_size, sample.num_computed_tokens - i * kv.block_size)
            if n > 0:
                filled[block] = max(filled.get(block, 0), n)
    return sum(filled.values()), len(filled) * kv.block_size


def step_records(scheduler, plan: StepPlan, result: StepResult, seconds: float) -> list[StepRecord]:
    """The records of one executed plan, read from the scheduler after it was applied.

    NOTE: a multi-step plan is recorded as the decode steps it ran, its time shared
    equally and each step's context one token longer than the step before: per-step
    FLOPs, bytes and batch sizes stay what the benchmark sums."""
    live, live_block_slots = live_slots(scheduler)
    kv = scheduler.kv
    allocated = (kv.num_total_blocks - kv.num_free_blocks) * kv.block_size
    num_steps = result.num_steps
    # Rows verifying drafts ran the LM head at 1 + drafts positions but kept fewer tokens.
    kept = Counter(token.seq_id for token in result.sampled)
    rejected = sum(1 + drafts - kept[seq_id] for seq_id, drafts in plan.num_drafts().items())
    records = []
    for substep in range(num_steps):
        rows = [(r.num_computed_tokens + substep, r.num_scheduled_tokens)
                for r in plan.new_requests + plan.cached_requests]
        records.append(StepRecord(
            seconds=seconds / num_steps,
            num_scheduled_tokens=plan.total_scheduled_tokens,
            num_sampled=len(result.sampled) // num_steps + rejected,
            num_seqs=len(rows),
            live_tokens=live,
            allocated_slots=allocated,
            live_block_slots=live_block_slots,
            attention_pairs=sum(n * c + n * (n + 1) // 2 for c, n in rows),
            kv_tokens_read=sum(c for c, _ in rows),
        ))
    return records
