"""A cluster's engine steps, read from its trace spans: what `bench serve` reports of
the steps behind the latencies its clients saw.

The scheduler ends a `scheduler.step` span per plan (attributes `llmserve.batch_size`,
`llmserve.num_scheduled_tokens`; from the plan sent to the worker until its result has
been applied and the outputs dispatched), and the worker a `worker.step` child of it
(its execute time; `llmserve.num_steps`: the decode steps a multi-step plan ran). With
LLMSERVE_SPAN_FILE set, each service appends them to that file as JSON lines (see
llmserve/telemetry/tracing.py), and no collector is needed.

A decode step: every scheduled sequence computed one token; it costs what its batch
size costs. A prefill step: some sequence computed a prompt chunk (or recomputed after
a preemption); it costs that plus the chunk. Clients see both kinds between their
tokens, so TPOT = decode steps + their share of the prefill steps + the round trips,
and these totals tell the three apart. TPOT averages over tokens, and a step of batch b
carries b of them: hence the decode totals by batch size beside the overall ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

SCHEDULER_STEP = "scheduler.step"
WORKER_STEP = "worker.step"


@dataclass
class StepTotals:
    num_decode_steps: int = 0  # A multi-step plan counts every decode step it ran.
    decode_step_seconds: float = 0.0  # scheduler.step spans, summed.
    decode_step_worker_seconds: float = 0.0  # Of that, the worker's (worker.step spans).
    decode_step_sequences: int = 0  # Batch sizes, summed (once per decode step).
    num_prefill_steps: int = 0
    prefill_step_seconds: float = 0.0
    prefill_step_tokens: int = 0  # Every token those steps computed, decodes included.
    num_decode_plans: int = 0  # Plans behind num_decode_steps (fewer with multi-step).
    # By batch size b: a step of batch b yields b tokens, so the time per output token
    # that clients see weighs it b times, and a step's time is not affine in b (one
    # sequence costs more than half of two on a CPU): the benchmark pairs batch by batch.
    decode_steps_by_batch: dict[int, int] = field(default_factory=dict)
    decode_seconds_by_batch: dict[int, float] = field(default_factory=dict)
    # Decode plans whose worker.step span was not found (a worker without the span
    # file): their worker time is unknown and they count as one step each.
    num_decode_plans_without_worker_span: int = 0

    def add(self, step: dict, workers: list[dict]) -> None:
        """One scheduler.step span and its worker.step children (one per rank of a
        parallel group: the slowest rank's time, which the scheduler waited for)."""
        a = step["attributes"]
        batch, tokens = a.get("llmserve.batch_size", 0), a.get("llmserve.num_scheduled_tokens", 0)
        seconds = _seconds(step)
        if batch > 0 and tokens == batch:
            num_steps = max((w["attributes"].get("llmserve.num_steps", 1) for w in workers), default=1)
            self.num_decode_plans += 1
            self.num_decode_steps += num_steps
            self.decode_step_seconds += seconds
            if workers:
                self.decode_step_worker_seconds += max(_seconds(w) for w in workers)
            else:
                self.num_decode_plans_without_worker_span += 1
            self.decode_step_sequences += batch * num_steps
            self.decode_steps_by_batch[batch] = self.decode_steps_by_batch.get(batch, 0) + num_steps
            self.decode_seconds_by_batch[batch] = self.decode_seconds_by_batch.get(batch, 0.0) + seconds
        elif tokens:
            self.num_prefill_steps += 1
            self.prefill_step_seconds += seconds
            self.prefill_step_tokens += tokens

    @property
    def worker_seconds_known(self) -> bool:
        return self.num_decode_plans_without_worker_span == 0


def _seconds(span: dict) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e9


def read_spans(path: str | Path) -> list[dict]:
    """Every span in a JSON-lines span file. A last line without its newline (a span
    being written by a running cluster) is left out."""
    lines = Path(path).read_text().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def step_totals(spans: Iterable[dict], start_ns: int = 0, end_ns: float = math.inf) -> StepTotals:
    """The totals of the scheduler.step spans that started within [start_ns, end_ns]
    (wall-clock nanoseconds, as the spans carry them), each with its worker.step children."""
    steps, workers = [], {}
    for s in spans:
        if s["name"] == SCHEDULER_STEP and start_ns <= s["start_ns"] <= end_ns:
            steps.append(s)
        elif s["name"] == WORKER_STEP:
            workers.setdefault((s["trace_id"], s["parent_span_id"]), []).append(s)
    totals = StepTotals()
    for s in sorted(steps, key=lambda s: s["start_ns"]):
        totals.add(s, workers.get((s["trace_id"], s["span_id"]), []))
    return totals
