"""The load of `llmserve bench serve`: requests arriving as a Poisson process (or all at
once), at most N in flight, each token's arrival time taken as its delta streams in;
and the latency figures of a run (TTFT, TPOT, ITL, end to end), as vLLM's bench takes them."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from llmserve.bench import cpu_usage
from llmserve.bench.workloads import BenchRequest


@dataclass
class RequestTiming:
    prompt_len: int
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # One entry per generated token.
    delta_times: list[float] = field(default_factory=list)  # One per streamed message (several tokens
    # each with --stream-interval > 1: ITL is the gap between messages, as vLLM's bench takes it).
    end: float = 0.0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT)."""
        n = len(self.token_times)
        return (self.end - self.token_times[0]) / (n - 1) if n > 1 else None


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def compute_metrics(timings: list[RequestTiming], duration: float) -> dict:
    ok = [t for t in timings if not t.error and t.token_times]
    itls = [b - a for t in ok for a, b in zip(t.delta_times, t.delta_times[1:])]
    out_tokens = sum(len(t.token_times) for t in ok)
    ms = 1000.0
    return {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(t.prompt_len for t in ok)) / duration,
        "ttft_ms": {k: v * ms for k, v in percentiles([t.ttft for t in ok]).items()},
        "tpot_ms": {k: v * ms for k, v in percentiles([t.tpot for t in ok if t.tpot is not None]).items()},
        "itl_ms": {k: v * ms for k, v in percentiles(itls).items()},
        "tokens_per_message": out_tokens / max(1, sum(len(t.delta_times) for t in ok)),
        "e2e_ms": {k: v * ms for k, v in percentiles([t.end - t.start for t in ok]).items()},
        # Requests in flight, time-averaged over the run: the batch size the engine ran at.
        "mean_concurrency": sum(t.end - t.start for t in ok) / duration if duration else 0.0,
    }


async def run_load(connect, requests: list[BenchRequest], request_rate: float, max_concurrency: int | None,
                   seed: int = 0) -> tuple[list[RequestTiming], float]:
    """`connect()`: a new LLMServeClient for the cluster under test."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    timings = [RequestTiming(len(r.prompt_token_ids)) for r in requests]

    async def one(client, r: BenchRequest, timing: RequestTiming) -> None:
        async with limit:
            timing.start = time.perf_counter()
            try:
                async for delta in client.generate(token_ids=r.prompt_token_ids, max_tokens=r.output_len,
                                                   temperature=0.0, ignore_eos=True):
                    now = time.perf_counter()
                    timing.token_times += [now] * len(delta.token_ids)
                    if delta.token_ids:
                        timing.delta_times.append(now)
            except Exception as err:  # A failed request is counted, not fatal to the run.
                timing.error = str(err)
            timing.end = time.perf_counter()

    async with connect() as client:
        tasks = []
        start = time.perf_counter()
        for r, timing in zip(requests, timings):
            tasks.append(asyncio.create_task(one(client, r, timing)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return timings, duration


async def measured_load(connect, requests: list[BenchRequest], args, pids: dict[str, int] | None = None):
    """run_load, with the wall-clock window it ran in (nanoseconds, the spans' clock) and
    the CPU time of the processes in `pids` (a launched cluster's) before and after."""
    cpu_before = cpu_usage.snapshot(pids) if pids else None
    start_ns = time.time_ns()
    timings, duration = await run_load(connect, requests, args.request_rate, args.max_concurrency, args.seed)
    end_ns = time.time_ns()
    cpu = (cpu_before, cpu_usage.snapshot(pids)) if pids else None
    return timings, duration, (start_ns, end_ns), cpu
