"""Lifetime wall-time totals of the engine loop's steps, split by what they computed.

A decode step (every scheduled sequence computed one token) costs what the batch size
costs; a prefill step (some sequence computed a prompt chunk, or recomputed after a
preemption) costs that plus the chunk. Clients see both kinds between their tokens, so
TPOT = decode steps + their share of the prefill steps + the round trips; these totals
let a benchmark (or an operator) tell those three apart from outside the process.
TPOT averages over tokens, and a step of batch b carries b of them: hence the decode
totals by batch size beside the overall ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.contract.plan import StepPlan


def is_decode_step(plan: StepPlan) -> bool:
    """True when every sequence in the plan computes exactly one token."""
    num_sequences = len(plan.new_requests) + len(plan.cached_requests)
    return num_sequences > 0 and plan.total_scheduled_tokens == num_sequences


@dataclass
class StepTimes:
    num_decode_steps: int = 0
    decode_step_seconds: float = 0.0  # Plan built -> result applied, summed.
    decode_step_worker_seconds: float = 0.0  # Of that, the worker's own execute time.
    decode_step_sequences: int = 0  # Batch sizes, summed.
    num_prefill_steps: int = 0
    prefill_step_seconds: float = 0.0
    prefill_step_tokens: int = 0  # Every token those steps computed, decodes included.
    num_decode_plans: int = 0  # Plans behind num_decode_steps (a multi-step plan runs several).
    # By batch size b: a step of batch b yields b tokens, so the time per output token
    # that clients see weighs it b times, and a step's time is not affine in b (one
    # sequence costs more than half of two on a CPU): a benchmark pairs batch by batch.
    decode_steps_by_batch: dict[int, int] = field(default_factory=dict)
    decode_seconds_by_batch: dict[int, float] = field(default_factory=dict)

    def record(self, plan: StepPlan, seconds: float, worker_seconds: float, num_steps: int = 1) -> None:
        """One plan's wall and worker time; a multi-step plan counts each decode step it ran."""
        if is_decode_step(plan):
            self.num_decode_plans += 1
            self.num_decode_steps += num_steps
            self.decode_step_seconds += seconds
            self.decode_step_worker_seconds += worker_seconds
            batch = plan.total_scheduled_tokens
            self.decode_step_sequences += batch * num_steps
            self.decode_steps_by_batch[batch] = self.decode_steps_by_batch.get(batch, 0) + num_steps
            self.decode_seconds_by_batch[batch] = self.decode_seconds_by_batch.get(batch, 0.0) + seconds
        elif plan.total_scheduled_tokens:
            self.num_prefill_steps += 1
            self.prefill_step_seconds += seconds
            self.prefill_step_tokens += plan.total_scheduled_tokens
