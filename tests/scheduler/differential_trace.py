"""Differential trace of the scheduler core: many seeded random workloads, one digest each.

Run before and after a refactor that must not change behaviour; the two outputs must be
byte-identical:

    .venv/bin/python -m tests.scheduler.differential_trace --out /tmp/trace_before.txt
    .venv/bin/python -m tests.scheduler.differential_trace --out /tmp/trace_after.txt
    cmp /tmp/trace_before.txt /tmp/trace_after.txt
    .venv/bin/python -m tests.scheduler.differential_trace --dump 17   # one workload's lines

Each workload drives a `Scheduler` with the testkit's FakeWorker (which checks every plan
against its own copy of each sequence and the KV slots it wrote) through random
arrivals (mixed prompt lengths, shared prefixes, n > 1, priorities, deadlines, stop
tokens, queue bounds), aborts, failed steps, and preemption by swap and by recompute
under a small block pool, with multi-step runs (some interrupted) and speculative
drafts. What is recorded, step by step:

    plan   step id, num_steps, finished ids, swap-out / swap-in / copy ops,
           new rows (seq id, tokens, blocks, computed, scheduled, drafts),
           cached rows (seq id, new blocks, computed, scheduled, drafts)
    out    every RequestOutput (tokens, logprobs, finish reason, error, codes, hints)
    state  the stats snapshot, the GPU and CPU free-block queue order, block events

NOTE: the sampling settings a plan carries to the worker (NewRequestData.sampling) are
left out on purpose, so that a change of their type or encoding (issue 30 replaced the
worker's own sampling type by SamplingParams) does not read as a scheduling change;
their effect shows anyway, through the seeds the fake worker draws tokens with.

Not a test module (no test_ prefix): pytest does not collect it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import random
import re
import sys
from collections.abc import Callable

from llmserve.contract.plan import StepPlan, StepResult
from llmserve.contract.sampling import SamplingParams
from llmserve.scheduler.admission import QueueFull
from llmserve.scheduler.preemption import PreemptionMode
from llmserve.scheduler.scheduler import KVCacheShape, Scheduler, SchedulerConfig

from tests.scheduler.scheduler_testkit import FakeWorker, WorkerRequest, hash_token, interrupt_some_runs

NUM_WORKLOADS = 1200
MAX_STEPS = 400


@dataclasses.dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    n: int
    priority: int
    deadline_in: float | None  # Steps of the fake clock after arrival, or None.
    bounded: bool  # submit() (queue bounds) rather than add_request().


def repeating_token(request: WorkerRequest, step_id: int) -> int:
    """A period-3 continuation, so n-gram drafts get accepted."""
    return request.token_ids[-3] if len(request.token_ids) >= 3 else 5


def draw_config(rng: random.Random) -> tuple[SchedulerConfig, KVCacheShape, tuple[int, ...]]:
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.choice([24, 32, 48])
    chunked = rng.random() < 0.7
    config = SchedulerConfig(
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(4, 40) if chunked else rng.randint(max_model_len, 80),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=rng.random() < 0.6,
        preemption_mode=rng.choice(list(PreemptionMode)),
        num_scheduler_steps=rng.choice([1, 1, 1, 2, 4]),
        num_speculative_tokens=rng.choice([0, 0, 0, 1, 3]),
        speculative_ngram_min=1,
        speculative_ngram_max=rng.choice([1, 2, 3]),
        max_queued_requests=rng.choice([None, None, 2, 4]),
        max_queued_tokens=rng.choice([None, None, 40, 120]),
    )
    # Small pools: preemption is the common case, not the exception.
    num_blocks = max(2, (max_model_len // block_size) * rng.choice([1, 1, 2, 3]) + rng.randint(0, 3))
    num_cpu_blocks = rng.choice([0, num_blocks // 2, num_blocks * 2])
    cache = KVCacheShape(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                         num_cpu_blocks=num_cpu_blocks)
    eos = (rng.randrange(97),) if rng.random() < 0.8 else ()
    return config, cache, eos


def draw_arrivals(rng: random.Random, max_model_len: int) -> list[Arrival]:
    prefixes = [[rng.randrange(1, 97) for _ in range(rng.randint(2, 16))] for _ in range(3)]
    arrivals = []
    for i in range(rng.randint(1, 12)):
        if rng.random() < 0.5:
            prompt = list(rng.choice(prefixes)) + [rng.randrange(1, 97) for _ in range(rng.randint(0, 8))]
        else:
            prompt = [rng.randrange(1, 97) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.03:
            prompt = prompt * 4  # Sometimes too long for max_model_len: refused.
        sampling = SamplingParams(
            max_tokens=rng.choice([1, 2, 4, 8, 16, 40]) if rng.random() > 0.02 else 0,
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.choice([None, rng.randrange(1000), 2**63 - 1]),
            ignore_eos=rng.random() < 0.2,
            logprobs=rng.choice([None, None, 0, 2]),
            stop_token_ids=tuple(rng.sample(range(97), rng.choice([0, 0, 1, 3]))),
        )
        arrivals.append(Arrival(
            step=rng.randint(0, 12), request_id=f"r{i}" if rng.random() > 0.05 else "r0", prompt=prompt,
            sampling=sampling, n=rng.choice([1, 1, 1, 2, 3]), priority=rng.choice([0, 0, 1, -1]),
            deadline_in=rng.choice([None, None, None, 1.5, 5.0, 20.0]), bounded=rng.random() < 0.5))
    return arrivals


class Trace:
    """The lines of one workload, and their digest."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._seq_ids: dict[int, int] = {}

    def sid(self, seq_id: int) -> int:
        """Sequence ids renumbered by first appearance: the process-wide counter's
        offset must not depend on which workloads ran before."""
        return self._seq_ids.setdefault(seq_id, len(self._seq_ids))

    def add(self, *parts: object) -> None:
        self.lines.append(" ".join(str(p) for p in parts))

    def digest(self) -> str:
        return hashlib.sha256("\n".join(self.lines).encode()).hexdigest()


def record_plan(trace: Trace, plan: StepPlan) -> None:
    trace.add("plan", plan.step_id, plan.num_steps, "fin", [trace.sid(i) for i in plan.finished_seq_ids],
              "out", plan.swap_out,
              "in", plan.swap_in, "cp", plan.copies)
    for r in plan.new_requests:  # NOTE: r.sampling left out (see the module docstring).
        trace.add("  new", trace.sid(r.seq_id), r.token_ids, r.num_prompt_tokens, r.block_ids, r.num_computed_tokens,
                  r.num_scheduled_tokens, r.draft_token_ids)
    for r in plan.cached_requests:
        trace.add("  cached", trace.sid(r.seq_id), r.new_block_ids, r.num_computed_tokens, r.num_scheduled_tokens,
                  r.draft_token_ids)


def record_outputs(trace: Trace, what: str, outputs) -> None:
    for o in outputs:
        logprobs = [(lp.token_id, lp.logprob, lp.top_token_ids, lp.top_logprobs) for lp in o.logprobs]
        trace.add(" ", what, o.request_id, o.index, o.new_token_ids, logprobs, o.finish_reason.name,
                  o.num_cached_tokens, o.stop_token_id, o.error_code.name, o.retry_after_ms, repr(o.error))


def record_state(trace: Trace, core: Scheduler) -> None:
    stats = dataclasses.asdict(core.stats())
    trace.add("  stats", sorted(stats.items()))
    trace.add("  free", core.kv.pool.free_block_ids())
    if core.kv.cpu_pool is not None:
        trace.add("  cpu-free", core.kv.cpu_pool.free_block_ids())
    trace.add("  events", core.take_block_events())


def arrive(trace: Trace, core: Scheduler, a: Arrival, now: float) -> None:
    deadline = now + a.deadline_in if a.deadline_in is not None else None
    try:
        if a.bounded:
            _, displaced = core.submit(a.request_id, a.prompt, a.sampling, n=a.n, priority=a.priority,
                                       deadline=deadline)
            record_outputs(trace, "displaced", displaced)
        else:
            core.add_request(a.request_id, a.prompt, a.sampling, n=a.n, priority=a.priority, deadline=deadline)
        trace.add("added", a.request_id, a.n, a.priority, deadline)
    except ValueError as err:
        trace.add("refused", a.request_id, repr(str(err)))
    except QueueFull as full:
        trace.add("full", a.request_id, full.reason, full.retry_after_ms, repr(str(full)))


def run_workload(seed: int) -> Trace:
    rng = random.Random(seed)
    config, cache, eos = draw_config(rng)
    arrivals = draw_arrivals(rng, cache.max_model_len)
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]
    core = Scheduler(config, cache, eos_token_ids=eos, clock=clock)
    token_fn = repeating_token if config.num_speculative_tokens and rng.random() < 0.5 else hash_token
    worker = FakeWorker(cache.block_size, token_fn=token_fn, logprobs=rng.random() < 0.3,
                        steps_to_run=interrupt_some_runs if rng.random() < 0.5 else None)
    trace = Trace()
    # NOTE: async_scheduling is a setting of the engine loop, not of the core this
    # drives, and these workloads run no sliding window: both left out so that traces
    # from before they existed still compare.
    trace.add("config", re.sub(r", async_scheduling=\w+", "", repr(config)),
              repr(cache).replace(", sliding_window=0", ""), eos)
    aborts = {rng.randint(0, 40): f"r{rng.randint(0, 11)}" for _ in range(rng.randint(0, 4))}
    failures = {rng.randint(0, 40) for _ in range(rng.choice([0, 0, 0, 1, 2]))}
    for step in range(MAX_STEPS):
        now[0] = float(step)
        for a in arrivals:
            if a.step == step:
                arrive(trace, core, a, now[0])
        if step in aborts:
            record_outputs(trace, "abort", core.abort_requests([aborts[step]]))
        if step > 30 and not core.has_unfinished_requests():
            break
        record_outputs(trace, "expired", core.expire(now[0]))
        plan = core.schedule()
        record_plan(trace, plan)
        if plan.is_empty:
            result = StepResult(plan.step_id)
        elif step in failures:
            result = StepResult(plan.step_id, error=f"injected failure at step {step}")
        else:
            result = worker.execute(plan)
        trace.add("result", result.num_steps, [(trace.sid(t.seq_id), t.token_id) for t in result.sampled], repr(result.error))
        record_outputs(trace, "out", core.update_from_output(plan, result))
        record_state(trace, core)
    left = [r for r in (f"r{i}" for i in range(12)) if core.get_request(r) is not None]
    record_outputs(trace, "cleanup", core.fail_requests(left, "trace over"))
    record_state(trace, core)
    audit = core.audit()
    trace.add("audit", audit.ok, audit.num_orphaned_blocks, audit.problems)
    return trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=int, default=NUM_WORKLOADS)
    parser.add_argument("--out", help="write the digests here (default: stdout)")
    parser.add_argument("--dump", type=int, help="print every line of this one workload instead")
    args = parser.parse_args(argv)
    if args.dump is not None:
        print("\n".join(run_workload(args.dump).lines))
        return 0
    total = hashlib.sha256()
    lines = []
    for seed in range(args.workloads):
        trace = run_workload(seed)
        digest = trace.digest()
        total.update(digest.encode())
        lines.append(f"{seed} {len(trace.lines)} {digest}")
    lines.append(f"total {args.workloads} {total.hexdigest()}")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    print(lines[-1], file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
