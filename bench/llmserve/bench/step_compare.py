"""A serve run's engine steps, and the in-process decode step its TPOT is set against.

The cluster's own steps come from its trace spans (step_spans.py): how long its decode
steps took at which batch, and what share of its time went to prompt tokens. TPOT is
then compared with in-process decode steps at the same batch sizes and context, timed
on the same machine right after the run (compare_with_decode_step)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from llmserve.bench import cpu_usage
from llmserve.bench.step_spans import StepTotals, read_spans, step_totals
from llmserve.bench.workloads import BenchRequest


def _per(total: float, count: float) -> float:
    """total / count, NaN when nothing was counted (a run without that kind of step)."""
    return total / count if count else math.nan


def engine_steps(d: StepTotals) -> dict:
    """The cluster's steps during the run (from its step spans): how long its decode
    steps took at what batch, and what share of its busy time went to steps that carried
    prompt tokens."""
    decodes, prefills = d.num_decode_steps, d.num_prefill_steps
    busy = d.decode_step_seconds + d.prefill_step_seconds
    # A step of batch b carries b tokens: TPOT, a mean over a request's tokens, weighs it
    # b times. Per batch size: the steps, the share of decoded tokens, the mean step.
    tokens = sum(b * n for b, n in d.decode_steps_by_batch.items())
    by_batch = {b: {"steps": n, "token_share": b * n / tokens, "ms": 1000 * d.decode_seconds_by_batch[b] / n}
                for b, n in sorted(d.decode_steps_by_batch.items())}
    worker_seconds = d.decode_step_worker_seconds if d.worker_seconds_known else math.nan
    return {
        "num_decode_steps": decodes,
        "num_prefill_steps": prefills,
        "decode_step_ms": 1000 * _per(d.decode_step_seconds, decodes),
        "decode_step_worker_ms": 1000 * _per(worker_seconds, decodes),
        "decode_batch": _per(d.decode_step_sequences, decodes),
        # What a generated token saw, on average: its step's batch (larger than the
        # per-step mean whenever the batch varies) and its step's time.
        "decode_batch_per_token": sum(b * v["token_share"] for b, v in by_batch.items()) if tokens else math.nan,
        "decode_step_ms_per_token": sum(v["ms"] * v["token_share"] for v in by_batch.values()) if tokens else math.nan,
        "decode_by_batch": by_batch,
        # Multi-step scheduling: decode steps per plan (1 without it; runs end early when a
        # request arrives or one is about to reach its max_tokens).
        "decode_steps_per_plan": _per(decodes, d.num_decode_plans),
        "prefill_step_ms": 1000 * _per(d.prefill_step_seconds, prefills),
        "prefill_step_tokens": _per(d.prefill_step_tokens, prefills),
        "prefill_time_share": _per(d.prefill_step_seconds, busy),
    }


def cluster_steps(span_file: str | Path, window: tuple[int, int], cpu=None) -> dict:
    """engine_steps of the scheduler.step spans that started within the run's window,
    with each process's CPU per step when `cpu` holds its snapshots."""
    path = Path(span_file)
    steps = engine_steps(step_totals(read_spans(path) if path.exists() else [], *window))
    if cpu is not None:
        steps["cpu"] = cpu_usage.cpu_per_step(*cpu, steps["num_decode_steps"] + steps["num_prefill_steps"])
    return steps


def batches_to_time(token_share: dict[int, float], coverage: float = 0.95, most: int = 12) -> dict[int, float]:
    """The batch sizes that carried most of the decoded tokens (largest shares first,
    until `coverage` of them, at most `most` sizes), with their shares renormalised."""
    chosen, covered = {}, 0.0
    for b, share in sorted(token_share.items(), key=lambda kv: -kv[1]):
        if covered >= coverage or len(chosen) == most:
            break
        chosen[b] = share
        covered += share
    return {b: share / covered for b, share in sorted(chosen.items())}


def compare_with_decode_step(metrics: dict, model_dir, dtype: str, requests: list[BenchRequest],
                             quantization: str = "none") -> None:
    """Times in-process decode steps at the run's batch sizes and mean context (same
    machine, right after the run) and sets TPOT median / their mix: what serving through
    the cluster, with arrivals and prefills in between, adds per token.

    With the cluster's step totals (from its step spans), the in-process step is timed at each batch size its
    decode steps ran (those carrying 95% of the decoded tokens) and mixed with the
    weights TPOT gives them: a step of batch b carries b tokens. A step's time is not
    affine in b (one sequence costs a CPU more than half of two), so neither the
    per-step mean batch (1.8 at 0.3 req/s here) nor the per-token one (2.5) stands for
    the mix. The cluster's own decode steps are mixed with the same weights, and the
    ratio splits in two:
      online decode step / in-process step   the cluster's own decode steps (round
                                             trips, other processes on the cores, drift)
      TPOT median / online decode step       arrivals' prefills sharing the steps
    Without the totals: the mean number of requests in flight, interpolated between the
    batch sizes either side.
    """
    from llmserve.bench.profile_step import time_decode_steps

    steps = metrics.get("engine_steps")
    known = steps is not None and steps["num_decode_steps"] > 0
    if known:
        weights = batches_to_time({b: v["token_share"] for b, v in steps["decode_by_batch"].items()})
        batch = steps["decode_batch_per_token"]
    else:
        batch = max(1.0, metrics["mean_concurrency"])
        low, frac = math.floor(batch), batch - math.floor(batch)
        weights = {low: 1.0 - frac, low + 1: frac} if frac else {low: 1.0}
    context = round(statistics.fmean(len(r.prompt_token_ids) + r.output_len / 2 for r in requests))
    # NOTE: at least 16 steps per batch size, in four interleaved chunks (drift).
    per_batch = max(16, 160 // len(weights) // 4 * 4)
    at_batch = {b: 1000 * t for b, t in time_decode_steps(model_dir, dtype, sorted(weights), context,
                                                           steps=per_batch, quantization=quantization).items()}
    step_ms = sum(w * at_batch[b] for b, w in weights.items())
    metrics["decode_step_ms"] = {"batch": batch, "context": context, "mean": step_ms,
                                 "at_batch": {str(b): ms for b, ms in at_batch.items()},
                                 "weights": {str(b): w for b, w in weights.items()}}
    metrics["tpot_median_over_decode_step"] = metrics["tpot_ms"]["median"] / step_ms
    if known:
        cluster_ms = sum(w * steps["decode_by_batch"][b]["ms"] for b, w in weights.items())
        metrics["decode_step_ms"]["cluster_mean"] = cluster_ms
        metrics["online_decode_step_over_in_process"] = cluster_ms / step_ms
        metrics["tpot_median_over_online_decode_step"] = metrics["tpot_ms"]["median"] / cluster_ms
